"""The names of the files in an artifact's directory, in one module that imports nothing: the
Hub resolver (`gss.hf.hub`) tells an artifact's repo from a model's by them, below the code that
reads and writes artifacts."""

CONFIG_NAME = "gss_config.json"
TENSORS_NAME = "gss_tensors.safetensors"
ARTIFACT_FILES = (CONFIG_NAME, TENSORS_NAME)
STACK_NAME = "gss_stack.json"  # a SteeringStack: this manifest and one artifact per steer-<i>
CARD_NAME = "README.md"  # the model card (gss.artifact.card)
