// plugins/src/attention_plugin.cpp
//
// Owns: the TensorRT face of the attention kernels: the IPluginV3 "EdgebuildAttention"
// version "1", namespace "edgebuild" (IPluginV3OneCore + IPluginV3OneBuildV2 +
// IPluginV3OneRuntime), its creator, and the plugin-library entry points getCreators /
// setLoggerFinder (dynamic registration: IPluginRegistry::loadLibrary, Python
// `trt.get_plugin_registry().load_library(path)`, trtexec --dynamicPlugins).
//
// The contract (inputs, attributes, outputs) is plugins/README.md = plugins/contract.json =
// the docstring of edgebuild.ops.attention. tests/test_plugin_contract.py parses kInputNames,
// kOutputNames and kAttributeFields below and compares them with contract.json and with the
// reference op's signature: keep the tables literal (one {"name", PluginFieldType::kX, required}
// entry per line).
//
// The math lives in attention_kernels.cu (eb_attention_enqueue); this file only maps TensorRT
// descriptors to EbAttentionParams. Compiled only where TensorRT headers exist (CMake).

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "edgebuild/attention_kernels.h"
#include "edgebuild/attention_params.h"

#if defined(NV_TENSORRT_MAJOR) && \
    (NV_TENSORRT_MAJOR < 10 || (NV_TENSORRT_MAJOR == 10 && NV_TENSORRT_MINOR < 3))
#error "EdgebuildAttention needs TensorRT >= 10.3 (IPluginV3OneBuildV2::getAliasedInput)"
#endif

namespace edgebuild {
namespace {

using nvinfer1::DataType;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::IExprBuilder;
using nvinfer1::ILogger;
using nvinfer1::IPluginCapability;
using nvinfer1::IPluginV3;
using nvinfer1::PluginCapabilityType;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

constexpr char kPluginName[] = "EdgebuildAttention";
constexpr char kPluginVersion[] = "1";
constexpr char kPluginNamespace[] = "edgebuild";

// Tensor inputs in contract order. q_norm_weight/k_norm_weight are present iff qk_norm = 1,
// tree_mask iff has_tree_mask = 1 (absent ones are skipped, the rest keep their order).
constexpr char const* kInputNames[] = {
    "qkv",
    "kv_cache",
    "page_table",
    "past_lengths",
    "input_lengths",
    "positions",
    "rope_cos_sin",
    "q_norm_weight",
    "k_norm_weight",
    "tree_mask",
};
enum Input : int32_t {
    kQkv = 0,
    kKvCache,
    kPageTable,
    kPastLengths,
    kInputLengths,
    kPositions,
    kRopeCosSin,
    kQNormWeight,
    kKNormWeight,
    kTreeMask,
    kNumInputKinds
};
// present_kv_cache aliases kv_cache (getAliasedInput): the pool is updated in place.
constexpr char const* kOutputNames[] = {
    "attn_out",
    "present_kv_cache",
};
static_assert(sizeof(kOutputNames) / sizeof(kOutputNames[0]) == 2, "getNbOutputs() returns 2");

struct Attributes {
    int32_t num_q_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t head_dim = 0;
    int32_t rotary_dim = 0;
    int32_t causal = 1;
    int32_t write_kv = 1;
    int32_t sliding_window = 0;
    float scale = 0.0f;
    float rms_norm_eps = 1e-6f;
    int32_t page_size = 0;
    int32_t qk_norm = 0;
    int32_t has_tree_mask = 0;
    int32_t fp8_kv_cache = 0;
    float kv_scale = 1.0f;
};

struct FieldSpec {
    char const* name;
    PluginFieldType type;
    bool required;
    int32_t Attributes::*int_member;
    float Attributes::*float_member;
};

// Plugin attributes (PluginFieldCollection), in contract.json order.
const FieldSpec kAttributeFields[] = {
    {"num_q_heads", PluginFieldType::kINT32, true, &Attributes::num_q_heads, nullptr},
    {"num_kv_heads", PluginFieldType::kINT32, true, &Attributes::num_kv_heads, nullptr},
    {"head_dim", PluginFieldType::kINT32, true, &Attributes::head_dim, nullptr},
    {"rotary_dim", PluginFieldType::kINT32, true, &Attributes::rotary_dim, nullptr},
    {"causal", PluginFieldType::kINT32, true, &Attributes::causal, nullptr},
    {"write_kv", PluginFieldType::kINT32, true, &Attributes::write_kv, nullptr},
    {"sliding_window", PluginFieldType::kINT32, false, &Attributes::sliding_window, nullptr},
    {"scale", PluginFieldType::kFLOAT32, true, nullptr, &Attributes::scale},
    {"rms_norm_eps", PluginFieldType::kFLOAT32, false, nullptr, &Attributes::rms_norm_eps},
    {"page_size", PluginFieldType::kINT32, true, &Attributes::page_size, nullptr},
    {"qk_norm", PluginFieldType::kINT32, false, &Attributes::qk_norm, nullptr},
    {"has_tree_mask", PluginFieldType::kINT32, false, &Attributes::has_tree_mask, nullptr},
    {"fp8_kv_cache", PluginFieldType::kINT32, false, &Attributes::fp8_kv_cache, nullptr},
    {"kv_scale", PluginFieldType::kFLOAT32, false, nullptr, &Attributes::kv_scale},
};
constexpr int32_t kNumAttributeFields =
    static_cast<int32_t>(sizeof(kAttributeFields) / sizeof(kAttributeFields[0]));

// ---- logging through the logger TensorRT hands to setLoggerFinder ----------------------------

std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

void plugin_log(ILogger::Severity severity, std::string const& message) {
    std::string const text = std::string(kPluginName) + ": " + message;
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr) {
        logger->log(severity, text.c_str());
    } else if (severity <= ILogger::Severity::kWARNING) {
        std::fprintf(stderr, "%s\n", text.c_str());
    }
}
void log_error(std::string const& message) { plugin_log(ILogger::Severity::kERROR, message); }

// The attributes alone (eb_validate_attributes, shared with the host build and the kernels'
// eb_validate_params): createPlugin has no tensors (the ONNX parser calls it with the node's
// attributes), so no shape or pointer is checked here; enqueue checks those
// (eb_attention_enqueue runs eb_validate_params on the real call). The io dtype is not known
// before configurePlugin: fp16 stands in (every io dtype has the same attribute rules).
bool validate(Attributes const& a, std::string* error) {
    if ((a.fp8_kv_cache != 0 && a.fp8_kv_cache != 1)) {
        *error = "fp8_kv_cache (" + std::to_string(a.fp8_kv_cache) + ") must be 0 or 1";
        return false;
    }
    EbAttentionParams p{};
    p.struct_size = sizeof(EbAttentionParams);
    p.num_q_heads = a.num_q_heads, p.num_kv_heads = a.num_kv_heads, p.head_dim = a.head_dim;
    p.rotary_dim = a.rotary_dim, p.page_size = a.page_size, p.sliding_window = a.sliding_window;
    p.causal = a.causal, p.write_kv = a.write_kv, p.qk_norm = a.qk_norm;
    p.has_tree_mask = a.has_tree_mask;
    p.io_dtype = EB_DTYPE_FLOAT16;
    p.kv_dtype = a.fp8_kv_cache ? EB_DTYPE_FP8_E4M3 : EB_DTYPE_FLOAT16;
    p.scale = a.scale, p.rms_norm_eps = a.rms_norm_eps, p.kv_scale = a.kv_scale;
    char msg[256] = {0};
    if (eb_validate_attributes(&p, msg, sizeof(msg)) != EB_OK) {
        *error = msg;
        return false;
    }
    return true;
}

bool is_float_io(DataType t) {
    return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16;
}

int32_t to_eb_dtype(DataType t) {
    switch (t) {
        case DataType::kFLOAT: return EB_DTYPE_FLOAT32;
        case DataType::kHALF: return EB_DTYPE_FLOAT16;
        case DataType::kBF16: return EB_DTYPE_BFLOAT16;
        case DataType::kFP8: return EB_DTYPE_FP8_E4M3;
        default: return -1;
    }
}

int64_t volume(nvinfer1::Dims const& d) {
    int64_t n = 1;
    for (int32_t i = 0; i < d.nbDims; ++i) {
        n *= d.d[i];
    }
    return n;
}

int32_t sm_version() {
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        return 0;
    }
    return major * 10 + minor;
}

class AttentionPlugin final : public IPluginV3,
                              public nvinfer1::IPluginV3OneCore,
                              public nvinfer1::IPluginV3OneBuildV2,
                              public nvinfer1::IPluginV3OneRuntime {
public:
    explicit AttentionPlugin(Attributes const& attributes) : mAttr(attributes) {
        for (int32_t kind = 0; kind < kNumInputKinds; ++kind) {
            if ((kind == kQNormWeight || kind == kKNormWeight) && !mAttr.qk_norm) continue;
            if (kind == kTreeMask && !mAttr.has_tree_mask) continue;
            mInputIndex[kind] = static_cast<int32_t>(mInputKinds.size());
            mInputKinds.push_back(kind);
        }
        initFieldsToSerialize();
    }
    AttentionPlugin(AttentionPlugin const& other)
        : mAttr(other.mAttr), mInputKinds(other.mInputKinds) {
        std::memcpy(mInputIndex, other.mInputIndex, sizeof(mInputIndex));
        initFieldsToSerialize();
    }
    AttentionPlugin& operator=(AttentionPlugin const&) = delete;
    ~AttentionPlugin() override = default;

    // ---- IPluginV3 ----
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
        switch (type) {
            case PluginCapabilityType::kBUILD:
                return static_cast<nvinfer1::IPluginV3OneBuildV2*>(this);
            case PluginCapabilityType::kRUNTIME:
                return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
            case PluginCapabilityType::kCORE:
                return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        }
        return nullptr;
    }
    IPluginV3* clone() noexcept override {
        try {
            return new AttentionPlugin(*this);
        } catch (std::exception const& e) {
            log_error(std::string("clone failed: ") + e.what());
            return nullptr;
        }
    }

    // ---- IPluginV3OneCore ----
    char const* getPluginName() const noexcept override { return kPluginName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // ---- IPluginV3OneBuild(V2) ----
    int32_t getNbOutputs() const noexcept override { return 2; }

    int32_t getAliasedInput(int32_t outputIndex) noexcept override {
        return outputIndex == 1 ? kKvCache : -1;  // present_kv_cache is kv_cache
    }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs,
                               DataType const* inputTypes, int32_t nbInputs) const noexcept override {
        if (nbOutputs != 2 || nbInputs != numInputs()) {
            return -1;
        }
        outputTypes[0] = inputTypes[kQkv];
        outputTypes[1] = inputTypes[kKvCache];
        return 0;
    }

    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                            int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                            IExprBuilder& exprBuilder) noexcept override {
        if (nbInputs != numInputs() || nbOutputs != 2 || inputs[kQkv].nbDims != 3 ||
            inputs[kKvCache].nbDims != 5) {
            log_error("getOutputShapes: expected " + std::to_string(numInputs()) +
                      " inputs with qkv [B, S, (Hq+2Hkv)*D] and kv_cache [pages, 2, Hkv, page, D]");
            return -1;
        }
        outputs[0].nbDims = 3;  // attn_out [B, S, Hq * D]
        outputs[0].d[0] = inputs[kQkv].d[0];
        outputs[0].d[1] = inputs[kQkv].d[1];
        outputs[0].d[2] = exprBuilder.constant(static_cast<int64_t>(mAttr.num_q_heads) * mAttr.head_dim);
        outputs[1] = inputs[kKvCache];  // present_kv_cache: same shape as the pool
        return 0;
    }

    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                   int32_t nbInputs, int32_t nbOutputs) noexcept override {
        if (nbInputs != numInputs() || nbOutputs != 2 || pos < 0 || pos >= nbInputs + nbOutputs) {
            return false;
        }
        PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR) {
            return false;
        }
        DataType const io = inOut[kQkv].desc.type;
        if (pos == nbInputs) {  // attn_out
            return desc.type == io;
        }
        if (pos == nbInputs + 1) {  // present_kv_cache
            return desc.type == inOut[kKvCache].desc.type;
        }
        switch (mInputKinds[pos]) {
            case kQkv: return is_float_io(desc.type);
            case kKvCache:
                // fp8 cache: fp16/bf16 activations only (the kernels' instantiations)
                return mAttr.fp8_kv_cache ? desc.type == DataType::kFP8 && io != DataType::kFLOAT
                                          : desc.type == io;
            case kPageTable:
            case kPastLengths:
            case kInputLengths:
            case kPositions: return desc.type == DataType::kINT32;
            case kRopeCosSin: return desc.type == DataType::kFLOAT;
            case kQNormWeight:
            case kKNormWeight: return desc.type == io;
            case kTreeMask:
                return desc.type == DataType::kBOOL || desc.type == DataType::kINT8 ||
                       desc.type == DataType::kUINT8;
            default: return false;
        }
    }

    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                            DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept override {
        std::string error;
        if (nbInputs != numInputs() || nbOutputs != 2) {
            error = "expected " + std::to_string(numInputs()) + " inputs and 2 outputs, got " +
                    std::to_string(nbInputs) + " and " + std::to_string(nbOutputs);
        } else {
            error = checkShapes(in);
        }
        if (error.empty() && mAttr.fp8_kv_cache && sm_version() < 89) {
            error = "fp8_kv_cache = 1 needs SM >= 89 (this GPU is sm_" +
                    std::to_string(sm_version()) + "); build this engine with fp8_kv_cache = 0";
        }
        if (!error.empty()) {
            log_error("configurePlugin: " + error);
            return -1;
        }
        return 0;
    }

    size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            DynamicPluginTensorDesc const* /*outputs*/,
                            int32_t /*nbOutputs*/) const noexcept override {
        if (nbInputs != numInputs()) {
            return 0;
        }
        nvinfer1::Dims const& qkvMax = inputs[kQkv].max;
        return eb_attention_workspace_size(static_cast<int32_t>(qkvMax.d[0]),
                                           static_cast<int32_t>(qkvMax.d[1]), mAttr.num_q_heads,
                                           mAttr.num_kv_heads, mAttr.head_dim,
                                           to_eb_dtype(inputs[kKvCache].desc.type));
    }

    // ---- IPluginV3OneRuntime ----
    int32_t onShapeChange(PluginTensorDesc const* /*in*/, int32_t nbInputs, PluginTensorDesc const* /*out*/,
                          int32_t nbOutputs) noexcept override {
        return nbInputs == numInputs() && nbOutputs == 2 ? 0 : -1;
    }

    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override {
        EbAttentionParams p = paramsFor(inputDesc, inputs, outputs);
        if (outputs[1] != inputs[kKvCache]) {
            // TensorRT did not alias the pool (aliasing needs the builder preview feature
            // kALIASED_PLUGIN_IO_10_03): carry it over, then update the output in place.
            size_t const bytes = static_cast<size_t>(volume(outputDesc[1].dims)) *
                                 (mAttr.fp8_kv_cache ? 1 : (p.io_dtype == EB_DTYPE_FLOAT32 ? 4 : 2));
            if (cudaMemcpyAsync(outputs[1], inputs[kKvCache], bytes, cudaMemcpyDeviceToDevice,
                                stream) != cudaSuccess) {
                log_error("enqueue: copying kv_cache into present_kv_cache failed");
                return -1;
            }
        }
        size_t const needed = eb_attention_workspace_size(p.batch, p.seq_len, p.num_q_heads,
                                                          p.num_kv_heads, p.head_dim, p.kv_dtype);
        char err[256] = {0};
        int32_t const status =
            eb_attention_enqueue(&p, workspace, needed, stream, EB_KERNEL_AUTO, err, sizeof(err));
        if (status != EB_OK) {
            log_error(std::string("enqueue: ") + err);
            return -1;
        }
        return 0;
    }

    IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept override {
        return clone();
    }

    PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &mFieldsToSerialize; }

private:
    int32_t numInputs() const { return static_cast<int32_t>(mInputKinds.size()); }
    int32_t indexOf(int32_t kind) const { return mInputIndex[kind]; }

    // Static dims must fit the attributes (dynamic ones are -1 at build time).
    std::string checkShapes(DynamicPluginTensorDesc const* in) const {
        auto const mismatch = [&](int32_t kind, int32_t dim, int64_t expected) -> std::string {
            nvinfer1::Dims const& d = in[indexOf(kind)].desc.dims;
            if (d.d[dim] >= 0 && d.d[dim] != expected) {
                return std::string(kInputNames[kind]) + " dim " + std::to_string(dim) + " is " +
                       std::to_string(d.d[dim]) + ", expected " + std::to_string(expected);
            }
            return "";
        };
        static constexpr int32_t kRanks[kNumInputKinds] = {3, 5, 2, 1, 1, 2, 2, 1, 1, 3};
        for (int32_t kind : mInputKinds) {
            if (in[indexOf(kind)].desc.dims.nbDims != kRanks[kind]) {
                return std::string(kInputNames[kind]) + " must have rank " +
                       std::to_string(kRanks[kind]);
            }
        }
        int64_t const D = mAttr.head_dim;
        std::string e = mismatch(kQkv, 2, (mAttr.num_q_heads + 2LL * mAttr.num_kv_heads) * D);
        if (e.empty()) e = mismatch(kKvCache, 1, 2);
        if (e.empty()) e = mismatch(kKvCache, 2, mAttr.num_kv_heads);
        if (e.empty()) e = mismatch(kKvCache, 3, mAttr.page_size);
        if (e.empty()) e = mismatch(kKvCache, 4, D);
        if (e.empty()) e = mismatch(kRopeCosSin, 1, mAttr.rotary_dim);
        if (e.empty() && mAttr.qk_norm) e = mismatch(kQNormWeight, 0, D);
        if (e.empty() && mAttr.qk_norm) e = mismatch(kKNormWeight, 0, D);
        return e;
    }

    EbAttentionParams paramsFor(PluginTensorDesc const* inputDesc, void const* const* inputs,
                                void* const* outputs) const {
        EbAttentionParams p{};
        p.struct_size = sizeof(EbAttentionParams);
        p.batch = static_cast<int32_t>(inputDesc[kQkv].dims.d[0]);
        p.seq_len = static_cast<int32_t>(inputDesc[kQkv].dims.d[1]);
        p.num_pages = static_cast<int32_t>(inputDesc[kKvCache].dims.d[0]);
        p.max_pages_per_seq = static_cast<int32_t>(inputDesc[kPageTable].dims.d[1]);
        p.max_position = static_cast<int32_t>(inputDesc[kRopeCosSin].dims.d[0]);
        p.num_q_heads = mAttr.num_q_heads, p.num_kv_heads = mAttr.num_kv_heads;
        p.head_dim = mAttr.head_dim, p.rotary_dim = mAttr.rotary_dim;
        p.page_size = mAttr.page_size, p.causal = mAttr.causal, p.write_kv = mAttr.write_kv;
        p.sliding_window = mAttr.sliding_window, p.qk_norm = mAttr.qk_norm;
        p.has_tree_mask = mAttr.has_tree_mask;
        p.io_dtype = to_eb_dtype(inputDesc[kQkv].type);
        p.kv_dtype = to_eb_dtype(inputDesc[kKvCache].type);
        p.scale = mAttr.scale, p.rms_norm_eps = mAttr.rms_norm_eps, p.kv_scale = mAttr.kv_scale;
        p.qkv = inputs[kQkv];
        p.kv_cache = outputs[1];  // in place (aliased, or carried over by enqueue)
        p.page_table = static_cast<int32_t const*>(inputs[kPageTable]);
        p.past_lengths = static_cast<int32_t const*>(inputs[kPastLengths]);
        p.input_lengths = static_cast<int32_t const*>(inputs[kInputLengths]);
        p.positions = static_cast<int32_t const*>(inputs[kPositions]);
        p.rope_cos_sin = static_cast<float const*>(inputs[kRopeCosSin]);
        if (mAttr.qk_norm) {
            p.q_norm_weight = inputs[indexOf(kQNormWeight)];
            p.k_norm_weight = inputs[indexOf(kKNormWeight)];
        }
        if (mAttr.has_tree_mask) {
            p.tree_mask = static_cast<uint8_t const*>(inputs[indexOf(kTreeMask)]);
        }
        p.out = outputs[0];
        return p;
    }

    void initFieldsToSerialize() {
        mSerialized.clear();
        for (FieldSpec const& spec : kAttributeFields) {
            void const* data = spec.int_member != nullptr
                                   ? static_cast<void const*>(&(mAttr.*spec.int_member))
                                   : static_cast<void const*>(&(mAttr.*spec.float_member));
            mSerialized.emplace_back(spec.name, data, spec.type, 1);
        }
        mFieldsToSerialize.nbFields = static_cast<int32_t>(mSerialized.size());
        mFieldsToSerialize.fields = mSerialized.data();
    }

    Attributes mAttr;
    std::vector<int32_t> mInputKinds;          // input position -> Input kind
    int32_t mInputIndex[kNumInputKinds] = {};  // Input kind -> position (if present)
    std::vector<PluginField> mSerialized;
    PluginFieldCollection mFieldsToSerialize{};
};

// Reads one field into the attributes; false (with a message) for a wrong type or value.
bool readField(PluginField const& field, FieldSpec const& spec, Attributes* attr, std::string* error) {
    if (field.data == nullptr || field.length < 1) {
        *error = std::string("attribute ") + spec.name + " has no data";
        return false;
    }
    if (spec.int_member != nullptr) {
        int64_t v = 0;
        if (field.type == PluginFieldType::kINT32) {
            v = *static_cast<int32_t const*>(field.data);
        } else if (field.type == PluginFieldType::kINT64) {
            v = *static_cast<int64_t const*>(field.data);
        } else {
            *error = std::string("attribute ") + spec.name + " must be an integer (kINT32)";
            return false;
        }
        if (v < INT32_MIN || v > INT32_MAX) {
            *error = std::string("attribute ") + spec.name + " is out of int32 range";
            return false;
        }
        attr->*spec.int_member = static_cast<int32_t>(v);
        return true;
    }
    if (field.type == PluginFieldType::kFLOAT32) {
        attr->*spec.float_member = *static_cast<float const*>(field.data);
    } else if (field.type == PluginFieldType::kFLOAT64) {
        attr->*spec.float_member = static_cast<float>(*static_cast<double const*>(field.data));
    } else {
        *error = std::string("attribute ") + spec.name + " must be a float (kFLOAT32)";
        return false;
    }
    return true;
}

class AttentionPluginCreator final : public nvinfer1::IPluginCreatorV3One {
public:
    AttentionPluginCreator() {
        for (FieldSpec const& spec : kAttributeFields) {
            mFields.emplace_back(spec.name, nullptr, spec.type, 1);
        }
        mFieldNames.nbFields = static_cast<int32_t>(mFields.size());
        mFieldNames.fields = mFields.data();
    }

    char const* getPluginName() const noexcept override { return kPluginName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
    PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldNames; }

    IPluginV3* createPlugin(char const* name, PluginFieldCollection const* fc,
                            nvinfer1::TensorRTPhase /*phase*/) noexcept override {
        try {
            Attributes attr;
            std::string error = parse(fc, &attr);
            if (error.empty() && !validate(attr, &error)) {
                error = "invalid attributes: " + error;
            }
            if (!error.empty()) {
                log_error(std::string("createPlugin(") + (name ? name : "") + "): " + error);
                return nullptr;
            }
            return new AttentionPlugin(attr);
        } catch (std::exception const& e) {
            log_error(std::string("createPlugin failed: ") + e.what());
            return nullptr;
        }
    }

private:
    // Unknown attributes are refused (a typo in the exporter must not silently fall back to a
    // default); the ONNX parser's plugin_version / plugin_namespace are skipped.
    static std::string parse(PluginFieldCollection const* fc, Attributes* attr) {
        bool seen[kNumAttributeFields] = {};
        for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
            PluginField const& field = fc->fields[i];
            if (field.name == nullptr || std::strcmp(field.name, "plugin_version") == 0 ||
                std::strcmp(field.name, "plugin_namespace") == 0) {
                continue;
            }
            int32_t index = -1;
            for (int32_t k = 0; k < kNumAttributeFields; ++k) {
                if (std::strcmp(field.name, kAttributeFields[k].name) == 0) index = k;
            }
            if (index < 0) {
                return std::string("unknown attribute ") + field.name + " (see plugins/contract.json)";
            }
            std::string error;
            if (!readField(field, kAttributeFields[index], attr, &error)) {
                return error;
            }
            seen[index] = true;
        }
        std::string missing;
        for (int32_t k = 0; k < kNumAttributeFields; ++k) {
            if (kAttributeFields[k].required && !seen[k]) {
                missing += std::string(missing.empty() ? "" : ", ") + kAttributeFields[k].name;
            }
        }
        return missing.empty() ? "" : "missing required attribute(s): " + missing;
    }

    std::vector<PluginField> mFields;
    PluginFieldCollection mFieldNames{};
};

}  // namespace
}  // namespace edgebuild

// ---- plugin library entry points -------------------------------------------------------------

extern "C" __attribute__((visibility("default"))) void setLoggerFinder(
    nvinfer1::ILoggerFinder* finder) {
    edgebuild::gLoggerFinder.store(finder);
}

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const*
getCreators(int32_t& nbCreators) {
    static edgebuild::AttentionPluginCreator sAttentionCreator;
    static nvinfer1::IPluginCreatorInterface* const kCreators[] = {&sAttentionCreator};
    nbCreators = static_cast<int32_t>(sizeof(kCreators) / sizeof(kCreators[0]));
    return kCreators;
}
