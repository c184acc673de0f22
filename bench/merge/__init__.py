"""Merging: soups and K-Merge on the built-in family and the real model, `bitdelta merge` speed."""
