"""Offline INT8 KV calibration (`kvedge calibrate`) and quality evaluation (`kvedge eval-kv`).

The quantization math and the scales file format live in `kvedge.quant`, shared with the runtime.
"""
