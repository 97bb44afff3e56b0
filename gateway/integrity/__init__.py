"""Checks that the engines serve what they were asked: the canary prober, provenance, first-token plausibility."""
