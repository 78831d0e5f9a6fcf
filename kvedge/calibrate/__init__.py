"""Offline KV cache calibration (INT8 per-group scales): see issue 4; not implemented yet."""
