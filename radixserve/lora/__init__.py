"""LoRA adapters served over the base model (--lora-paths): adapter.py reads and checks PEFT
adapters, manager.py wraps the model's projections and applies each step's adapters."""
