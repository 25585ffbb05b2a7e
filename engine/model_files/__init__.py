"""Model files, torch-free: everything read from a model's files before any weight is.

- `gguf`: the one GGUF container reader (metadata, tensor directory, raw bytes);
- `vocab`: a tokenizer's vocabulary, special tokens and byte table from GGUF metadata or
  a Hugging Face directory;
- `chat_templates`: the model's chat template rendered in HF's Jinja sandbox;
- `aliases`: model names (aliases, paths, URIs) -> local files;
- `errors`: the checkpoint error types.

The weights loader (`engine.loader`), the tokenizer (`engine.tokenizer`) and the gateway
(`agent.gateway.tokens`) all use these; nothing here imports torch, so the gateway and
platform images can.
"""
