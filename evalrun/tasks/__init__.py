"""Task adapters (MMLU, HumanEval), the task registry and the code-execution sandbox."""
