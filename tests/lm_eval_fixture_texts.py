"""The task files of tests/lm_eval_fixtures.py: lm-eval YAMLs and hooks in its own formats."""

# --- task files --------------------------------------------------------------------------------
# Templates use $name (string.Template) so that jinja's {{ }} stays as written.
ARC_YAML = """\
task: arc_tiny
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    train: $train
    test: $test
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{choices.label.index(answerKey)}}"
doc_to_choice: "{{choices.text}}"
should_decontaminate: true
doc_to_decontamination_query: "Question: {{question}}\\nAnswer:"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

# ARC_YAML as a second task with lm-eval's acc_mutual_info (unconditional ("", choice) requests)
ARC_MI_YAML = ARC_YAML.replace("task: arc_tiny", "tag:\n  - tiny_loglik\ntask: arc_mi_tiny").replace(
    "metadata:", "  - metric: acc_mutual_info\n    aggregation: mean\n    higher_is_better: true\nmetadata:")

# lm_eval/tasks/lambada/lambada_openai.yaml over local data
LAMBADA_YAML = """\
tag:
  - tiny_loglik
task: lambada_tiny
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: $test
output_type: loglikelihood
test_split: test
doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
doc_to_target: "{{' '+text.split(' ')[-1]}}"
should_decontaminate: true
doc_to_decontamination_query: "{{text}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

HELLASWAG_YAML = """\
task: hellaswag_tiny
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    train: $train
    validation: $validation
output_type: multiple_choice
training_split: train
validation_split: validation
test_split: null
process_docs: !function utils.process_docs
doc_to_text: "{{query}}"
doc_to_target: "{{label}}"
doc_to_choice: "choices"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

# lm_eval/tasks/hellaswag/utils.py, unchanged
HELLASWAG_UTILS = '''\
import re

import datasets


def preprocess(text):
    text = text.strip()
    # NOTE: Brackets are artifacts of the WikiHow dataset portion of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\\\[.*?\\\\]", "", text)
    text = text.replace("  ", " ")
    return text


def process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    def _process_doc(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        out_doc = {
            "query": preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [preprocess(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }
        return out_doc

    return dataset.map(_process_doc)
'''

GSM8K_YAML = """\
tag:
  - tiny_tag
task: gsm8k_tiny
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    train: $train
    test: $test
output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore:
      - ","
      - "\\\\$$"
      - "(?s).*#### "
      - "\\\\.$$"
generation_kwargs:
  until:
    - "Question:"
    - "</s>"
    - "<|im_end|>"
  do_sample: false
  temperature: 0.0
  max_gen_toks: 32
repeats: 1
num_fewshot: 5
fewshot_config:
  sampler: first_n
filter_list:
  - name: "strict-match"
    filter:
      - function: "regex"
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: "take_first"
  - name: "flexible-extract"
    filter:
      - function: "regex"
        group_select: -1
        regex_pattern: "(-?[$$0-9.,]{2,})|(-?[0-9]+)"
      - function: "take_first"
metadata:
  version: 3.0
"""

WIKITEXT_YAML = """\
tag:
  - tiny_tag
task: wikitext_tiny
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: $test
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function preprocess_wikitext.wikitext_detokenizer
process_results: !function preprocess_wikitext.process_results
should_decontaminate: true
doc_to_decontamination_query: "{{page}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 2.0
"""

TINY_SUITE_YAML = """\
group: tiny_suite
task:
  - arc_tiny
  - hellaswag_tiny
aggregate_metric_list:
  - metric: acc
    aggregation: mean
    weight_by_size: true
metadata:
  version: 1.0
"""

# lm_eval/tasks/mmlu/default/mmlu_<subject>.yaml with the data read from local parquet files
MMLU_SUBJECT_YAML = """\
include: $template
task: mmlu_local_$subject
task_alias: $subject
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: $test
    dev: $dev
process_docs: !function mmlu_utils.process_$subject
description: $description
"""

MMLU_GROUP_YAML = """\
group: mmlu_local
task:
$members
aggregate_metric_list:
  - metric: acc
    weight_by_size: true
metadata:
  version: 2
"""

MMLU_UTILS_HEAD = '''\
"""process_docs for mmlu_local_<subject>: the rows of one subject of the all-subject parquet files."""

import datasets


def _subject(dataset: datasets.Dataset, subject: str) -> datasets.Dataset:
    return dataset.filter(lambda doc: doc["subject"] == subject)
'''

MMLU_UTILS_SUBJECT = '''

def process_$subject(dataset: datasets.Dataset) -> datasets.Dataset:
    return _subject(dataset, "$subject")
'''

# lm_eval/tasks/wikitext/preprocess_wikitext.py, unchanged
WIKITEXT_UTILS = '''\
import re


def wikitext_detokenizer(doc):
    string = doc["page"]
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    # double brackets
    string = re.sub(r"\\(\\s*([^\\)]*?)\\s*\\)", r"(\\1)", string)
    string = re.sub(r"\\[\\s*([^\\]]*?)\\s*\\]", r"[\\1]", string)
    string = re.sub(r"{\\s*([^}]*?)\\s*}", r"{\\1}", string)
    string = re.sub(r"\\"\\s*([^\\"]*?)\\s*\\"", r'"\\1"', string)
    string = re.sub(r"'\\s*([^']*?)\\s*'", r"'\\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \\n", "\\n")
    string = string.replace("\\n ", "\\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")

    return string


def process_results(doc, results):
    (loglikelihood,) = results
    # IMPORTANT: wikitext counts number of words in *original doc before detokenization*
    _words = len(re.split(r"\\s+", doc["page"]))
    _bytes = len(doc["page"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, _words),
        "byte_perplexity": (loglikelihood, _bytes),
        "bits_per_byte": (loglikelihood, _bytes),
    }
'''
