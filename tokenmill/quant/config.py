"""QuantConfig: which method, with what grouping; read from / written to HF `quantization_config`."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("int8", "smoothquant", "gptq", "awq", "nf4", "rtn4")
LOAD_TIME_METHODS = ("int8", "nf4", "rtn4")     # need no calibration data


@dataclass(slots=True)
class QuantConfig:
    method: str
    bits: int = 4
    group_size: int = 128
    act_order: bool = False        # GPTQ desc_act
    damp_percent: float = 0.01     # GPTQ
    alpha: float = 0.5             # SmoothQuant migration strength
    block_size: int = 64           # NF4 absmax block
    double_quant: bool = True      # NF4
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.method in ("int8", "smoothquant"):
            self.bits = 8
        elif self.bits != 4:
            raise ValueError(f"{self.method} supports bits=4 only, got {self.bits}")
        if self.method in ("gptq", "awq", "rtn4") and self.group_size not in (-1, 32, 64, 128, 256):
            raise ValueError(f"group_size must be 32, 64, 128, 256 or -1 (per row), got {self.group_size}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"smoothquant alpha must be in (0, 1), got {self.alpha}")

    def to_hf(self) -> dict[str, Any]:
        """The `quantization_config` block: AutoGPTQ / AutoAWQ keys for those two methods so their
        loaders (and vLLM's) recognise the checkpoint; tokenmill's own keys otherwise."""
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                    "desc_act": self.act_order, "sym": False, "damp_percent": self.damp_percent,
                    "checkpoint_format": "gptq", "lm_head": self.quantize_lm_head}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}
        return {"quant_method": "tokenmill", **asdict(self)}

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> "QuantConfig":
        kind = qc.get("quant_method")
        if kind == "gptq":
            # symmetric GPTQ is the same format with every zero point at 8: it loads unchanged
            if qc.get("checkpoint_format", "gptq") != "gptq" or qc.get("bits", 4) != 4:
                raise ValueError(f"unsupported GPTQ checkpoint: bits={qc.get('bits')} "
                                 f"checkpoint_format={qc.get('checkpoint_format')} (supported: 4-bit 'gptq')")
            return cls("gptq", bits=4, group_size=qc.get("group_size", 128), act_order=qc.get("desc_act", False),
                       quantize_lm_head=qc.get("lm_head", False))
        if kind == "awq":
            if qc.get("version", "gemm").lower() != "gemm" or not qc.get("zero_point", True) or qc.get("bits", 4) != 4:
                raise ValueError(f"unsupported AWQ checkpoint: version={qc.get('version')} zero_point="
                                 f"{qc.get('zero_point')} bits={qc.get('bits')} (supported: 4-bit GEMM with zeros)")
            return cls("awq", bits=4, group_size=qc.get("q_group_size", qc.get("group_size", 128)))
        if kind == "tokenmill":
            fields = {k: v for k, v in qc.items() if k != "quant_method"}
            return cls(**fields)
        raise ValueError(f"unsupported quantization_config quant_method {kind!r} (supported: gptq, awq, tokenmill)")
