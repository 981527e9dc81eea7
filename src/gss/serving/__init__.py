"""Serving integrations: apply a gss artifact inside an inference server's own forward.

`gss.serving.vllm_plugin` is a vLLM general plugin (entry point group ``vllm.general_plugins``)
that steers, per request, the decoder block(s) an artifact was calibrated on. Nothing here is
imported by ``import gss``: the module imports vLLM only when vLLM calls it.
"""
