"""MMLU's four subject groups, as lm-evaluation-harness reports them (`mmlu_stem`, `mmlu_humanities`,
`mmlu_social_sciences`, `mmlu_other`).

Copied from lm-eval 0.4.13's packaged task files, lm_eval/tasks/mmlu/default/: each
`mmlu_<subject>.yaml` has `tag: mmlu_<group>_tasks`, and `_mmlu_<group>.yaml` gives the group's
`group_alias` (its display name). tests/test_mmlu_prompt.py checks both against those files.
"""
from __future__ import annotations

from typing import Optional

GROUPS = ("stem", "humanities", "social_sciences", "other")

# lm-eval's `group_alias`, the name its results table prints
GROUP_DISPLAY_NAME = {
    "stem": "stem",
    "humanities": "humanities",
    "social_sciences": "social sciences",
    "other": "other",
}

SUBJECT_GROUP: dict[str, str] = {
    # stem (19)
    "abstract_algebra": "stem",
    "anatomy": "stem",
    "astronomy": "stem",
    "college_biology": "stem",
    "college_chemistry": "stem",
    "college_computer_science": "stem",
    "college_mathematics": "stem",
    "college_physics": "stem",
    "computer_security": "stem",
    "conceptual_physics": "stem",
    "electrical_engineering": "stem",
    "elementary_mathematics": "stem",
    "high_school_biology": "stem",
    "high_school_chemistry": "stem",
    "high_school_computer_science": "stem",
    "high_school_mathematics": "stem",
    "high_school_physics": "stem",
    "high_school_statistics": "stem",
    "machine_learning": "stem",
    # humanities (13)
    "formal_logic": "humanities",
    "high_school_european_history": "humanities",
    "high_school_us_history": "humanities",
    "high_school_world_history": "humanities",
    "international_law": "humanities",
    "jurisprudence": "humanities",
    "logical_fallacies": "humanities",
    "moral_disputes": "humanities",
    "moral_scenarios": "humanities",
    "philosophy": "humanities",
    "prehistory": "humanities",
    "professional_law": "humanities",
    "world_religions": "humanities",
    # social_sciences (12)
    "econometrics": "social_sciences",
    "high_school_geography": "social_sciences",
    "high_school_government_and_politics": "social_sciences",
    "high_school_macroeconomics": "social_sciences",
    "high_school_microeconomics": "social_sciences",
    "high_school_psychology": "social_sciences",
    "human_sexuality": "social_sciences",
    "professional_psychology": "social_sciences",
    "public_relations": "social_sciences",
    "security_studies": "social_sciences",
    "sociology": "social_sciences",
    "us_foreign_policy": "social_sciences",
    # other (13)
    "business_ethics": "other",
    "clinical_knowledge": "other",
    "college_medicine": "other",
    "global_facts": "other",
    "human_aging": "other",
    "management": "other",
    "marketing": "other",
    "medical_genetics": "other",
    "miscellaneous": "other",
    "nutrition": "other",
    "professional_accounting": "other",
    "professional_medicine": "other",
    "virology": "other",
}


def group_of(subject: str) -> Optional[str]:
    """The group of an MMLU subject, or None for a subject MMLU does not have (e.g. a user's own data)."""
    return SUBJECT_GROUP.get(subject)
