"""Starting runs: the command line and local multi-process launch."""
