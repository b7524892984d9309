"""Placeholder until the study report lands."""
