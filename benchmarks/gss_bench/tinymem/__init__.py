"""TinyMem (Sakarvadia et al.): small GPT-2 models that memorize noised or backdoored rows."""
