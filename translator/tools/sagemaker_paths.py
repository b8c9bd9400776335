"""SageMaker's container paths mapped to folders of your own machines, for the launch scripts ``convert`` writes.

In a SageMaker job the script writes its model to ``/opt/ml/model`` (``SM_MODEL_DIR``), its output to
``/opt/ml/output`` and its checkpoints to ``/opt/ml/checkpoints`` (the estimator's ``checkpoint_local_path``, synced
to ``checkpoint_s3_uri``), and reads each input channel from ``/opt/ml/input/data/<name>`` (``SM_CHANNEL_<NAME>``).
Outside SageMaker those folders rarely exist. :func:`map_paths` rewrites a launch's environment and command line:
the ``SM_*`` folders point into the given ones, and every occurrence of a SageMaker path in a variable or an
argument (a hyperparameter ``--checkpoint-dir /opt/ml/checkpoints``) is replaced by its mapped folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

MODEL, OUTPUT, CHECKPOINTS, INPUT_DATA = "/opt/ml/model", "/opt/ml/output", "/opt/ml/checkpoints", "/opt/ml/input/data"


def path_map(output_dir: str | None, checkpoint_dir: str | None, channels: Mapping[str, str]) -> dict[str, str]:
    """SageMaker path -> local folder, longest first (so ``/opt/ml/input/data/train`` wins over its parent)."""
    out: dict[str, str] = {}
    if output_dir:
        out[MODEL] = os.path.join(output_dir, "model")
        out[OUTPUT] = os.path.join(output_dir, "output")
    if checkpoint_dir:
        out[CHECKPOINTS] = checkpoint_dir
    for name, path in channels.items():
        out[f"{INPUT_DATA}/{name}"] = path
    return dict(sorted(out.items(), key=lambda item: -len(item[0])))


def _mapped(text: str, paths: Mapping[str, str]) -> str:
    for sagemaker, local in paths.items():
        text = text.replace(sagemaker, local)
    return text


def map_paths(env: Mapping[str, str], argv: Sequence[str], output_dir: str | None, checkpoint_dir: str | None,
              channels: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``env`` and ``argv`` with SageMaker's paths replaced (see the module docstring) and the channels set."""
    paths = path_map(output_dir, checkpoint_dir, channels)
    new_env = {name: _mapped(str(value), paths) for name, value in env.items()}
    if output_dir:
        new_env["SM_MODEL_DIR"] = paths[MODEL]
        new_env["SM_OUTPUT_DIR"] = paths[OUTPUT]
        new_env["SM_OUTPUT_DATA_DIR"] = os.path.join(paths[OUTPUT], "data")
    if channels:
        for name, path in channels.items():
            new_env[f"SM_CHANNEL_{name.upper()}"] = path
        new_env["SM_CHANNELS"] = json.dumps(sorted(channels), separators=(",", ":"))
    return new_env, [_mapped(arg, paths) for arg in argv]
