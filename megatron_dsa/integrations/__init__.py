"""Adapters to host frameworks.

`megatron_config` (field translation) and `checkpoint` (state-dict interchange) need nothing beyond
this package; `megatron` (layer specs for Megatron-Core models) imports `megatron.core` when it
builds something, so `pip install "megatron_dsa[megatron]"` is only needed to use it.
"""
