"""Search: the Hypothesis state machines, exploration, shrinking, enumeration, rounds and jobs."""
