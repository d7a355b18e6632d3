"""Membership of a run: process groups, and leaving them (teardown.py)."""
