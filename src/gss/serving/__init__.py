"""Serving integrations: apply a gss artifact inside an inference server's own forward.

`gss.serving.vllm_plugin` is a vLLM general plugin (entry point group ``vllm.general_plugins``)
that steers, per request, the decoder block(s) an artifact was calibrated on: vLLM's hooks. The
op it puts in the forward is `gss.serving.vllm_op` (on CUDA, `gss.serving.triton_steer`), the
names and settings a server reads `gss.serving.vllm_settings`, and `gss serve` is
`gss.serving.serve`. Nothing here is imported by ``import gss``: the plugin imports vLLM only
when vLLM calls it.
"""
