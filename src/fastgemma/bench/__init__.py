"""Benchmark entries that compare several engine variants side by side in one process."""
