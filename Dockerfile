FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY spark ./spark
RUN pip install --no-cache-dir .
COPY policies ./policies
ENTRYPOINT ["delay-sidecar"]
CMD ["run"]
