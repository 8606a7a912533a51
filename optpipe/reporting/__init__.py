"""Results as views: report.json/report.md, report.html, and inspect/diff of finished runs."""
