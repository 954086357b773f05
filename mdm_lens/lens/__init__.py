"""Lenses over denoising steps. `linear`: linear probes per (layer × step) on recorded activations."""

from mdm_lens.lens.linear import (COLUMNS, POOLED, POOLS, PROBES, ProbeFeatures, auc, features_from_cache,
                                  fit_logistic, fit_ridge, item_split, probe_grid, r2)

__all__ = ["ProbeFeatures", "features_from_cache", "item_split", "auc", "r2", "fit_logistic", "fit_ridge",
           "probe_grid", "POOLS", "PROBES", "POOLED", "COLUMNS"]
