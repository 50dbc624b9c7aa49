"""Hugging Face models in and out, one module per concern:

* llama.py, gpt2.py — each architecture our decoders share with transformers, both directions:
  the parameter map, the spec read from a config.json, the config.json an export writes;
* weights.py — those checkpoints read slice by slice into our decoders (`model.init_from`);
* auto.py — any checkpoint transformers builds, trained as its own class (`model.name=hf`);
* build.py — transformers' Llama/GPT-2 built from a preset (`model.name=hf-llama-*`).
"""
