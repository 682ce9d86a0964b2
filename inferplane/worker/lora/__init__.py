"""LoRA adapters over a shared base model: reading and checking PEFT adapters (adapter.py), the
engine's fixed adapter slots (slots.py) and the projections that add each row's adapter (modules.py).
"""

from inferplane.worker.lora.adapter import AdapterError, LoraAdapter, LoraRequest, load_adapter
from inferplane.worker.lora.modules import install
from inferplane.worker.lora.slots import AdapterSlots

__all__ = ["AdapterError", "AdapterSlots", "LoraAdapter", "LoraRequest", "install", "load_adapter"]
