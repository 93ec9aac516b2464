"""Run untrusted generated code against trusted tests: worker + checker + verdict pipe.

    from evalrun.tasks.sandbox import CheckSpec, Sandbox
    with Sandbox() as box:
        result = box.run(CheckSpec(program=prompt + completion,
                                   check_source=prompt + "\n" + test, entry_point=entry_point))

See sandbox.py for the design and isolation.py for the isolation levels.
"""
from .sandbox import Sandbox
from .spec import CheckSpec, ExecResult, SandboxLimits

__all__ = ["CheckSpec", "ExecResult", "Sandbox", "SandboxLimits"]
