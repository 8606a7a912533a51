"""The content-addressed cache: stage entries, locks and leases, and its maintenance (ls/gc/verify)."""
