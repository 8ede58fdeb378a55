"""`text_similarity`: the field's metrics between the rendered input and reference, in [0, 1].

fuzzy_match is rapidfuzz's WRatio over normalised text (lower case, punctuation out), the
score OpenAI's own grader guide computes; bleu is sacrebleu's sentence BLEU; gleu and
meteor are nltk's sentence scores; rouge_1..5 and rouge_l are Google's rouge-score F1
(stemmed). `cosine` needs an embedding model and meteor needs the WordNet corpus, which
nothing here ships: both are refused by `metric_function` with a message saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from .base import GraderConfigError, Sample
from .per_sample import PerSampleGrader
from .spec import TextSimilarityGrader
from .templates import render_template

__all__ = ["TextSimilarity", "metric_function"]

Metric = Callable[[str, str], float]

_ROUGE = {f"rouge_{n}": f"rouge{n}" for n in range(1, 6)} | {"rouge_l": "rougeL"}


def _fuzzy_match(text: str, ref: str) -> float:
    from rapidfuzz import fuzz, utils

    return fuzz.WRatio(text, ref, processor=utils.default_process) / 100.0


def _bleu(text: str, ref: str) -> float:
    return _bleu_metric().sentence_score(text, [ref]).score / 100.0


@cache
def _bleu_metric() -> Any:
    from sacrebleu.metrics import BLEU

    # effective_order: a short sentence without 4-gram matches still gets a non-zero score.
    return BLEU(effective_order=True)


def _gleu(text: str, ref: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([ref.split()], text.split()))


def _meteor(text: str, ref: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    return float(meteor_score([ref.split()], text.split()))


def _meteor_available() -> bool:
    try:
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
    except (ImportError, LookupError):
        return False
    return True


@cache
def _rouge_scorer(kind: str) -> Any:
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer([kind], use_stemmer=True)


def _rouge(kind: str) -> Metric:
    def score(text: str, ref: str) -> float:
        scorer = _rouge_scorer(kind)
        return float(scorer.score(ref, text)[kind].fmeasure)

    return score


def metric_function(metric: str, *, field: str = "evaluation_metric") -> Metric:
    """The function computing `metric`; GraderConfigError for one not offered here."""
    if metric == "fuzzy_match":
        return _fuzzy_match
    if metric == "bleu":
        return _bleu
    if metric == "gleu":
        return _gleu
    if metric in _ROUGE:
        return _rouge(_ROUGE[metric])
    if metric == "meteor":
        if not _meteor_available():
            raise GraderConfigError(
                "meteor needs nltk's WordNet corpus, which is not installed on this box "
                "(an operator can add it with `python -m nltk.downloader wordnet`); use "
                "bleu, gleu, fuzzy_match or a rouge metric",
                field=field,
            )
        return _meteor
    if metric == "cosine":
        raise GraderConfigError(
            "cosine needs an embedding model, which this box does not serve for grading; "
            "use fuzzy_match, bleu, gleu or a rouge metric",
            field=field,
        )
    raise GraderConfigError(f"unknown evaluation_metric {metric!r}", field=field)


class TextSimilarity(PerSampleGrader):
    """The metric's score between the rendered `input` (candidate) and `reference`."""

    def __init__(self, spec: TextSimilarityGrader, *, field: str = "grader") -> None:
        self.name = spec.name
        self._spec = spec
        self._metric = metric_function(spec.evaluation_metric, field=f"{field}.evaluation_metric")

    def score(self, sample: Sample, item: dict) -> float:
        text = render_template(self._spec.input, sample, item)
        ref = render_template(self._spec.reference, sample, item)
        return self._metric(text, ref)
