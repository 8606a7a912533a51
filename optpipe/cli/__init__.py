"""The command line: `optpipe compile|validate|passes|export|inspect|diff|report|cache`."""
from optpipe.cli.main import cli, main

__all__ = ["cli", "main"]
