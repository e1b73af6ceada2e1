"""Trials: the five scenarios, and judging the bug zoo."""
