"""A stage's measured figures (accuracy, latency, peak memory) as the evaluation cache keeps them."""
from __future__ import annotations

from optpipe.core.results import Accuracy, Latency, Memory


def encode_figures(accuracy: Accuracy | None, latency: list[Latency], memory: Memory | None = None) -> dict:
    """A stage's measured figures as the evaluation cache keeps them (`decode_figures` reads them back)."""
    return {
        "accuracy": accuracy.model_dump(mode="json") if accuracy else None,
        "latency": [lat.model_dump(mode="json") for lat in latency],
        "memory": memory.model_dump(mode="json") if memory else None,
    }


def decode_figures(value: dict) -> tuple[Accuracy | None, list[Latency], Memory | None]:
    accuracy = Accuracy.model_validate(value["accuracy"]) if value.get("accuracy") else None
    memory = Memory.model_validate(value["memory"]) if value.get("memory") else None
    return accuracy, [Latency.model_validate(lat) for lat in value["latency"]], memory
