"""A Hugging Face encoder checkpoint with a new sequence-classification head: the causal LM
family's answers, but one label per row, and no pipeline cut (its plan is a causal LM's) or
sequence split."""

from __future__ import annotations

import dataclasses

from shardwise.models.families.hf_causal import HF_CAUSAL_LM

HF_CLASSIFIER = dataclasses.replace(
    HF_CAUSAL_LM,
    task="classification",
    classifier=True,
    pipeline="none",
    context_parallel=False,  # one label per row from the last token: a row is not split
    cp_model_types=(),
    sp_model_types=(),  # its head pools one token of the row, which sp would split over tp
)
