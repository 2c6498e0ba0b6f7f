#!/usr/bin/env bash
# Create bench/.venv with the peer queues and felix-redis (editable). Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv bench/.venv
bench/.venv/bin/pip install -q --upgrade pip
bench/.venv/bin/pip install -r bench/requirements.txt
bench/.venv/bin/pip install -e .
echo "bench/.venv ready: bench/.venv/bin/python -m bench --help"
