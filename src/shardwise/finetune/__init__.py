"""Fine-tuning conversions applied to the model on meta, before parallelisation: LoRA adapters
through peft (lora.py) and a frozen NF4 base under them, QLoRA, through bitsandbytes
(quant.py). The 8-bit optimizer is optim.py's (optim.name=adamw8bit)."""
