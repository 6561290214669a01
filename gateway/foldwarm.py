"""Imported once by the fold processes' fork server (`foldcpu.ProcessCPU`): what every fold process
needs, loaded before it forks them. A new fold process then starts as a fork with the summarizer's
modules and its token encoding in memory (loading o200k takes about a second) instead of paying
for them before its first fold. The encoding is the one `ProcessCPU` names in the environment
before the fork server starts."""

from __future__ import annotations

import os

from gateway import foldcpu, summarizer  # noqa: F401 (imported for the forks)
from gateway.tokens import load_encoding

ENV = "GATEWAY_FOLD_ENCODING"

if os.environ.get(ENV):
    load_encoding(os.environ[ENV])
