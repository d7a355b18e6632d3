"""Emulated multi-host clusters on one machine (``paratrain cluster``)."""
