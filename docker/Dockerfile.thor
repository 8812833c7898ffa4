# docker/Dockerfile.thor
#
# Owns: the Jetson Thor image that builds edgebuild's TensorRT plugin library and installs
# edgebuild (build engines on the device, run edgellm-serve).
#
# Base image choice: JetPack 7 (L4T r38, CUDA 13) makes Jetson Thor a standard arm64 SBSA
# system, so NVIDIA's multi-arch NGC TensorRT image runs on it; 25.08 carries CUDA 13.0 and
# TensorRT 10.13 (the plugin needs >= 10.3 for aliased, in-place KV-cache I/O). The
# l4t-jetpack images end with JetPack 6 (r36, CUDA 12, Orin); for Orin build with
#   --build-arg BASE_IMAGE=nvcr.io/nvidia/l4t-jetpack:r36.4.0 --build-arg CUDA_ARCHS=87
# Build (from the repository root, on the device or with an arm64 builder):
#   docker build -f docker/Dockerfile.thor -t edgebuild:thor .
# Run: docker run --runtime nvidia --network host -v /data:/data edgebuild:thor \
#        edgellm-serve /data/bundle
ARG BASE_IMAGE=nvcr.io/nvidia/tensorrt:25.08-py3
FROM ${BASE_IMAGE}

# sm_110 = Thor in CUDA 13 numbering (CUDA 12.8/12.9 called it sm_101)
ARG CUDA_ARCHS=110

RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake g++ curl rsync \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/edgebuild
COPY . .

# The CMake summary must say it builds edgebuild_plugins; fail the image otherwise.
RUN cmake -S plugins -B build/plugins -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS}" \
    && cmake --build build/plugins -j"$(nproc)" \
    && test -f build/plugins/libedgebuild_plugins.so \
    && install -m 0755 build/plugins/libedgebuild_plugins.so \
        build/plugins/libedgebuild_attention_host.so /usr/local/lib/ \
    && ldconfig
# doctor, the engine builder and the TensorRT runtime backend find the plugin here.
ENV EDGEBUILD_PLUGIN_LIB=/usr/local/lib/libedgebuild_plugins.so

# TensorRT's Python bindings come with the base image; edgebuild on top of them.
RUN python3 -m pip install --no-cache-dir . \
    && edgebuild --help >/dev/null

LABEL org.opencontainers.image.title="edgebuild (Jetson Thor)" \
      edgebuild.plugin_library="/usr/local/lib/libedgebuild_plugins.so"
EXPOSE 8000
CMD ["edgebuild", "--help"]
