#!/bin/bash
# Builds .dev/site.tgz: the packages the project needs that the lent GPU machines lack (Python 3.12 there,
# nothing installable), for `bench/gpu.sh` to unpack onto PYTHONPATH. Run here, from the repository root:
#   bash bench/gpu_kit.sh
# then, with the device tool: run(command="STEPS=\"tests attention async\" bash bench/gpu.sh $OUT", carry=[".dev"],
# timeout_s=600), and the other steps in a second call.
# The versions are this venv's. transformers travels too: that image's is older than pyproject's floor.
# Ray's Java jars, dashboard front end and libraries the project never imports (rllib, data, serve, train,
# tune) stay behind, so that the kit and the working tree fit in the 64 MiB a call carries.
set -eu
venv_python=${VENV_PYTHON:-.venv/bin/python}
version() { "$venv_python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
packages=(antlr4-python3-runtime jsonschema jsonschema-specifications omegaconf pyzmq ray referencing rpds-py
          transformers)
pins=()
for name in "${packages[@]}"; do pins+=("$name==$(version "$name")"); done
# bench/vs_trl.py --device cuda (gpu.sh's trl step): TRL and datasets are not in this venv nor on the GPU
# machine (which has accelerate, pyarrow, psutil and xxhash); datasets' own pins of dill and multiprocess
pins+=(trl==1.16.0 datasets "dill<0.4.1" "multiprocess<0.70.19")
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf .dev && mkdir -p .dev/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .dev/wheels "${pins[@]}"
python3 -m pip install -q --no-deps --no-compile --no-index --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --target .dev/site .dev/wheels/*.whl
rm -rf .dev/site/ray/{jars,rllib,data,serve,train,tune,dashboard/client} .dev/site/bin .dev/wheels
tar czf .dev/site.tgz -C .dev/site . && rm -rf .dev/site
echo "built .dev/site.tgz ($(du -m .dev/site.tgz | cut -f1) MiB): ${pins[*]}"
