"""Memorization-mitigation methods the paper compares against, in the same harness as GSS."""

from .steering import MeanDifferenceSteer, mean_difference_vector

__all__ = ["MeanDifferenceSteer", "mean_difference_vector"]
