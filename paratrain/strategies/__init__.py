"""Training modes, one class each, chosen by name from registry.STRATEGIES."""
