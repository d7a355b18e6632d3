"""Communication: process groups and cluster discovery (codecs and hooks join here)."""
