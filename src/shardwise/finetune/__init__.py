"""Fine-tuning conversions applied to the model on meta, before parallelisation: LoRA
adapters through peft (lora.py)."""
