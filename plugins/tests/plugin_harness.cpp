// plugins/tests/plugin_harness.cpp
//
// Owns: driving the EdgebuildAttention plugin library the way TensorRT does, against the real
// TensorRT C++ headers, on a machine without TensorRT or a GPU.
//
//   edgebuild_plugin_harness LIBRARY CASE_FILE OUT_DIR [--no-enqueue]
//
// dlopens LIBRARY (libedgebuild_plugins.so; built under -DEB_KERNEL_EMULATION its kernels run
// on the CPU through plugins/tests/cuda_emulation.h, so enqueue works on host memory), calls
// setLoggerFinder and getCreators, then in TensorRT's order:
//   creator getFieldNames; createPlugin(kBUILD) from the case's fields (typed as TensorRT's ONNX
//   parser types node attributes: int -> kINT32, float -> kFLOAT32, string -> kCHAR);
//   getCapabilityInterface(kCORE / kBUILD / kRUNTIME); getNbOutputs; getOutputDataTypes and
//   supportsFormatCombination over every DataType x TensorFormat (positions in order, each
//   asked only with the earlier positions set to accepted types, as the builder does);
//   getOutputShapes with a small IExprBuilder that folds constants; configurePlugin;
//   getWorkspaceSize; getAliasedInput; getFieldsToSerialize -> createPlugin(kRUNTIME) round
//   trip; clone; attachToContext; onShapeChange; enqueue on host memory (the case's tensors).
// The harness checks only what needs no oracle (round trips, identities) and prints one line
// per fact; tests/test_plugin_harness.py compares those lines with plugins/contract.json and
// the outputs it writes to OUT_DIR (attn_out.bin, present_kv_cache.bin) with the Python
// reference op. --no-enqueue stops before onShapeChange/enqueue (for the real, nvcc-built library
// on a machine without a GPU). Exit status: 0 if every CHECK passed and enqueue ran, 1
// otherwise, 2 on usage.
//
// CASE_FILE, one record per line (# comments):
//   field NAME int|float|string VALUE
//   input NAME DTYPE RANK DIM... FILE      DTYPE: float32 float16 bfloat16 float8_e4m3fn int32
//                                          bool; DIM: N (static) or N:SYMBOL (dynamic at build
//                                          time, given as SYMBOL to getOutputShapes and as -1
//                                          to configurePlugin); FILE raw bytes, relative to
//                                          the case file
//   alias 0|1                              outputs[1] is inputs[1]'s memory (default 1)

#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace nvinfer1;

int gFailures = 0;

void check(bool ok, std::string const& what, std::string const& detail = "") {
    std::printf("CHECK %s %s%s%s\n", ok ? "PASS" : "FAIL", what.c_str(), detail.empty() ? "" : " ",
                detail.c_str());
    if (!ok) ++gFailures;
}

char const* dtypeName(DataType t) {
    switch (t) {
        case DataType::kFLOAT: return "float32";
        case DataType::kHALF: return "float16";
        case DataType::kBF16: return "bfloat16";
        case DataType::kFP8: return "float8_e4m3fn";
        case DataType::kINT8: return "int8";
        case DataType::kUINT8: return "uint8";
        case DataType::kINT32: return "int32";
        case DataType::kINT64: return "int64";
        case DataType::kBOOL: return "bool";
        default: return nullptr;
    }
}

std::string dtypeText(DataType t) {
    char const* name = dtypeName(t);
    return name != nullptr ? name : "dtype" + std::to_string(static_cast<int>(t));
}

bool parseDtype(std::string const& name, DataType* out) {
    for (int32_t i = 0; i < EnumMax<DataType>(); ++i) {
        if (dtypeText(static_cast<DataType>(i)) == name) {
            *out = static_cast<DataType>(i);
            return true;
        }
    }
    return false;
}

size_t dtypeBytes(DataType t) {
    switch (t) {
        case DataType::kFLOAT:
        case DataType::kINT32: return 4;
        case DataType::kHALF:
        case DataType::kBF16: return 2;
        case DataType::kINT64: return 8;
        default: return 1;
    }
}

std::string formatText(TensorFormat f) {
    return f == TensorFormat::kLINEAR ? "linear" : "format" + std::to_string(static_cast<int>(f));
}

char const* fieldTypeText(PluginFieldType t) {
    switch (t) {
        case PluginFieldType::kINT32: return "INT32";
        case PluginFieldType::kFLOAT32: return "FLOAT32";
        case PluginFieldType::kCHAR: return "CHAR";
        case PluginFieldType::kINT64: return "INT64";
        case PluginFieldType::kFLOAT64: return "FLOAT64";
        default: return "OTHER";
    }
}

// ---- a small IExprBuilder: constants fold, everything else is a named symbol -------------------

class Expr final : public IDimensionExpr {
public:
    struct Impl final : public apiv::VDimensionExpr {
        bool constant = false;
        int64_t value = 0;
        bool isConstant() const override { return constant; }
        int64_t getConstantValue() const override {
            return constant ? value : std::numeric_limits<int64_t>::min();
        }
        bool isSizeTensor() const override { return false; }
    };
    Expr(bool constant, int64_t value, std::string text) : mText(std::move(text)) {
        mState.constant = constant;
        mState.value = value;
        mImpl = &mState;
    }
    std::string const& text() const { return mText; }

private:
    Impl mState;
    std::string mText;
};

class ExprBuilderImpl final : public apiv::VExprBuilder {
public:
    IDimensionExpr const* constant(int64_t value) override {
        return make(true, value, std::to_string(value));
    }
    IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& a,
                                    IDimensionExpr const& b) override {
        static char const* const kOps[] = {"+", "*", "max", "min", "-", "==", "<", "//", "ceildiv"};
        int32_t const index = static_cast<int32_t>(op);
        std::string const name = index >= 0 && index < 9 ? kOps[index] : "?";
        if (a.isConstant() && b.isConstant()) {
            int64_t const x = a.getConstantValue(), y = b.getConstantValue();
            int64_t v = 0;
            switch (op) {
                case DimensionOperation::kSUM: v = x + y; break;
                case DimensionOperation::kPROD: v = x * y; break;
                case DimensionOperation::kMAX: v = x > y ? x : y; break;
                case DimensionOperation::kMIN: v = x < y ? x : y; break;
                case DimensionOperation::kSUB: v = x - y; break;
                case DimensionOperation::kEQUAL: v = x == y; break;
                case DimensionOperation::kLESS: v = x < y; break;
                case DimensionOperation::kFLOOR_DIV: v = y != 0 ? x / y : 0; break;
                case DimensionOperation::kCEIL_DIV: v = y != 0 ? (x + y - 1) / y : 0; break;
            }
            return make(true, v, std::to_string(v));
        }
        return make(false, 0, "(" + textOf(a) + name + textOf(b) + ")");
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&,
                                            IDimensionExpr const&) override {
        check(false, "getOutputShapes", "declared a size tensor (the plugin has none)");
        return nullptr;
    }
    IDimensionExpr const* symbol(std::string const& name) { return make(false, 0, name); }
    static std::string textOf(IDimensionExpr const& e) { return static_cast<Expr const&>(e).text(); }

private:
    IDimensionExpr const* make(bool constant, int64_t value, std::string text) {
        mOwned.push_back(std::make_unique<Expr>(constant, value, std::move(text)));
        return mOwned.back().get();
    }
    std::vector<std::unique_ptr<Expr>> mOwned;
};

class ExprBuilder final : public IExprBuilder {
public:
    explicit ExprBuilder(ExprBuilderImpl* impl) { mImpl = impl; }
};

// ---- logger / resource context ------------------------------------------------------------------

class Logger final : public ILogger {
public:
    void log(Severity severity, char const* msg) noexcept override {
        std::printf("LOG %d %s\n", static_cast<int>(severity), msg);
    }
};

class LoggerFinder final : public ILoggerFinder {
public:
    ILogger* findLogger() override { return &mLogger; }

private:
    Logger mLogger;
};

class ResourceContext final : public IPluginResourceContext {
public:
    IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
    IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
};

// ---- the case ---------------------------------------------------------------------------------------

struct FieldValue {
    std::string name;
    PluginFieldType type;
    std::vector<uint8_t> bytes;  // int32 / float32 / chars
    int32_t length;
};

struct Tensor {
    std::string name;
    DataType type = DataType::kFLOAT;
    Dims dims{};                       // concrete
    std::vector<std::string> symbols;  // per dim: "" = static
    std::vector<uint8_t> data;
};

struct Case {
    std::vector<FieldValue> fields;
    std::vector<Tensor> inputs;
    bool alias = true;
};

std::vector<uint8_t> readFile(std::string const& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        throw std::runtime_error("cannot read " + path);
    }
    return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

int64_t volume(Dims const& d) {
    int64_t n = 1;
    for (int32_t i = 0; i < d.nbDims; ++i) n *= d.d[i];
    return n;
}

Case readCase(std::string const& path) {
    std::string const dir = path.substr(0, path.find_last_of('/') + 1);
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read case file " + path);
    Case c;
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream words(line);
        std::string kind;
        if (!(words >> kind) || kind[0] == '#') continue;
        if (kind == "field") {
            std::string name, type, value;
            words >> name >> type >> value;
            FieldValue f{name, PluginFieldType::kINT32, {}, 1};
            if (type == "int") {
                int32_t v = std::stoi(value);
                f.bytes.resize(4);
                std::memcpy(f.bytes.data(), &v, 4);
            } else if (type == "float") {
                float v = std::stof(value);
                f.type = PluginFieldType::kFLOAT32;
                f.bytes.resize(4);
                std::memcpy(f.bytes.data(), &v, 4);
            } else if (type == "string") {
                f.type = PluginFieldType::kCHAR;
                f.bytes.assign(value.begin(), value.end());
                f.bytes.push_back(0);
                f.length = static_cast<int32_t>(value.size());
            } else {
                throw std::runtime_error("field " + name + ": unknown type " + type);
            }
            c.fields.push_back(f);
        } else if (kind == "input") {
            Tensor t;
            std::string type, file;
            words >> t.name >> type >> t.dims.nbDims;
            if (!parseDtype(type, &t.type)) throw std::runtime_error("input " + t.name + ": dtype " + type);
            for (int32_t i = 0; i < t.dims.nbDims; ++i) {
                std::string dim;
                words >> dim;
                size_t const colon = dim.find(':');
                t.dims.d[i] = std::stoll(dim.substr(0, colon));
                t.symbols.push_back(colon == std::string::npos ? "" : dim.substr(colon + 1));
            }
            words >> file;
            t.data = readFile(dir + file);
            size_t const expected = static_cast<size_t>(volume(t.dims)) * dtypeBytes(t.type);
            if (t.data.size() != expected) {
                throw std::runtime_error("input " + t.name + ": " + file + " has " +
                                         std::to_string(t.data.size()) + " bytes, expected " +
                                         std::to_string(expected));
            }
            c.inputs.push_back(std::move(t));
        } else if (kind == "alias") {
            int v = 1;
            words >> v;
            c.alias = v != 0;
        } else {
            throw std::runtime_error("unknown record " + kind);
        }
    }
    return c;
}

// ---- helpers over serialized fields ----------------------------------------------------------------

std::string fieldBytesHex(PluginField const& f) {
    size_t bytes = 0;
    switch (f.type) {
        case PluginFieldType::kINT32:
        case PluginFieldType::kFLOAT32: bytes = 4u * static_cast<size_t>(f.length); break;
        case PluginFieldType::kINT64:
        case PluginFieldType::kFLOAT64: bytes = 8u * static_cast<size_t>(f.length); break;
        default: bytes = static_cast<size_t>(f.length); break;
    }
    std::string hex;
    char buf[3];
    for (size_t i = 0; f.data != nullptr && i < bytes; ++i) {
        std::snprintf(buf, sizeof(buf), "%02x", static_cast<uint8_t const*>(f.data)[i]);
        hex += buf;
    }
    return hex;
}

std::string fieldValueText(PluginField const& f) {
    if (f.data == nullptr) return "null";
    if (f.type == PluginFieldType::kINT32) return std::to_string(*static_cast<int32_t const*>(f.data));
    if (f.type == PluginFieldType::kFLOAT32) {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(*static_cast<float const*>(f.data)));
        return buf;
    }
    return "hex:" + fieldBytesHex(f);
}

std::map<std::string, std::string> serializedFields(IPluginV3* plugin) {
    std::map<std::string, std::string> out;
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* fc = runtime != nullptr ? runtime->getFieldsToSerialize() : nullptr;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
        PluginField const& f = fc->fields[i];
        out[f.name] = std::string(fieldTypeText(f.type)) + "/" + std::to_string(f.length) + "/" + fieldBytesHex(f);
    }
    return out;
}

// ---- the run ------------------------------------------------------------------------------------------

// ---- the steps, in TensorRT's order ----------------------------------------------------------

struct Interfaces {
    IPluginV3OneCore* core = nullptr;
    IPluginV3OneBuildV2* build = nullptr;
    IPluginV3OneRuntime* runtime = nullptr;
};

// dlopen + setLoggerFinder + getCreators + getFieldNames (as IPluginRegistry::loadLibrary).
IPluginCreatorV3One* loadCreator(char const* libraryPath) {
    void* handle = dlopen(libraryPath, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        check(false, "dlopen", dlerror());
        return nullptr;
    }
    using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
    using SetLoggerFinder = void (*)(ILoggerFinder*);
    auto getCreators = reinterpret_cast<GetCreators>(dlsym(handle, "getCreators"));
    auto setLoggerFinder = reinterpret_cast<SetLoggerFinder>(dlsym(handle, "setLoggerFinder"));
    check(getCreators != nullptr, "entry point getCreators");
    check(setLoggerFinder != nullptr, "entry point setLoggerFinder");
    if (getCreators == nullptr || setLoggerFinder == nullptr) return nullptr;
    static LoggerFinder finder;
    setLoggerFinder(&finder);
    int32_t nbCreators = 0;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    check(nbCreators == 1 && creators != nullptr && creators[0] != nullptr, "getCreators",
          std::to_string(nbCreators) + " creator(s)");
    if (nbCreators < 1 || creators == nullptr || creators[0] == nullptr) return nullptr;
    InterfaceInfo const info = creators[0]->getInterfaceInfo();
    check(std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0, "creator interface kind", info.kind);
    auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
    std::printf("CREATOR %s %s %s\n", creator->getPluginName(), creator->getPluginVersion(),
                creator->getPluginNamespace());
    PluginFieldCollection const* names = creator->getFieldNames();
    for (int32_t i = 0; names != nullptr && i < names->nbFields; ++i) {
        std::printf("FIELDNAME %s %s %d\n", names->fields[i].name, fieldTypeText(names->fields[i].type),
                    names->fields[i].length);
    }
    return creator;
}

// getCapabilityInterface for each type; TensorRT casts by the interface info (no RTTI across
// the library boundary), as here.
Interfaces capabilities(IPluginV3* plugin) {
    Interfaces i;
    i.core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    i.build = static_cast<IPluginV3OneBuildV2*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    i.runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    check(i.core != nullptr, "getCapabilityInterface(kCORE)");
    check(i.build != nullptr, "getCapabilityInterface(kBUILD)");
    check(i.runtime != nullptr, "getCapabilityInterface(kRUNTIME)");
    if (i.core == nullptr || i.build == nullptr || i.runtime == nullptr) return Interfaces{};
    check(std::strcmp(i.core->getInterfaceInfo().kind, "PLUGIN_V3ONE_CORE") == 0, "core interface kind");
    check(std::strcmp(i.build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0, "build interface kind");
    check(i.build->getInterfaceInfo().major == 2, "build interface is V2 (getAliasedInput)");
    check(std::strcmp(i.runtime->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0,
          "runtime interface kind");
    std::printf("CORE %s %s %s\n", i.core->getPluginName(), i.core->getPluginVersion(),
                i.core->getPluginNamespace());
    return i;
}

void printSerialized(IPluginV3OneRuntime* runtime) {
    PluginFieldCollection const* ser = runtime->getFieldsToSerialize();
    for (int32_t i = 0; ser != nullptr && i < ser->nbFields; ++i) {
        std::printf("SERIALIZEDVALUE %s %s\n", ser->fields[i].name, fieldValueText(ser->fields[i]).c_str());
    }
}

// supportsFormatCombination position by position, each asked with every earlier position set to
// an accepted type (the builder's order); every DataType x TensorFormat at each position.
void formatCombinations(IPluginV3OneBuildV2* build, Case const& c) {
    int32_t const nbInputs = static_cast<int32_t>(c.inputs.size()), nbIO = nbInputs + 2;
    std::vector<DynamicPluginTensorDesc> io(static_cast<size_t>(nbIO));
    for (int32_t i = 0; i < nbInputs; ++i) io[i].desc.dims = c.inputs[i].dims;
    std::set<std::string> combos;
    std::function<void(int32_t, std::string const&)> explore = [&](int32_t pos, std::string const& prefix) {
        if (pos == nbIO) {
            combos.insert(prefix);
            return;
        }
        for (int32_t t = 0; t < EnumMax<DataType>(); ++t) {
            for (int32_t f = 0; f < EnumMax<TensorFormat>(); ++f) {
                io[pos].desc.type = static_cast<DataType>(t);
                io[pos].desc.format = static_cast<TensorFormat>(f);
                if (build->supportsFormatCombination(pos, io.data(), nbInputs, 2)) {
                    std::string const item = dtypeText(io[pos].desc.type) + "/" + formatText(io[pos].desc.format);
                    explore(pos + 1, prefix.empty() ? item : prefix + "," + item);
                }
            }
        }
    };
    explore(0, "");
    for (std::string const& combo : combos) std::printf("COMBINATION %s\n", combo.c_str());
    check(!combos.empty(), "supportsFormatCombination accepts some combination");
    check(!build->supportsFormatCombination(nbIO, io.data(), nbInputs, 2),
          "supportsFormatCombination refuses a position past the outputs");
    check(!build->supportsFormatCombination(0, io.data(), nbInputs + 1, 2),
          "supportsFormatCombination refuses a wrong input count");
}

// getOutputShapes: static dims as constants, dynamic ones as symbols. Returns the rc.
int32_t outputShapes(IPluginV3OneBuildV2* build, Case const& c, ExprBuilderImpl& impl, DimsExprs out[2]) {
    ExprBuilder exprBuilder(&impl);
    int32_t const nbInputs = static_cast<int32_t>(c.inputs.size());
    std::vector<DimsExprs> in(static_cast<size_t>(nbInputs));
    for (int32_t i = 0; i < nbInputs; ++i) {
        Tensor const& t = c.inputs[i];
        in[i].nbDims = t.dims.nbDims;
        for (int32_t d = 0; d < t.dims.nbDims; ++d) {
            in[i].d[d] = t.symbols[d].empty() ? exprBuilder.constant(t.dims.d[d]) : impl.symbol(t.symbols[d]);
        }
    }
    int32_t const rc = build->getOutputShapes(in.data(), nbInputs, nullptr, 0, out, 2, exprBuilder);
    std::printf("OUTPUTSHAPES %d\n", rc);
    for (int32_t o = 0; rc == 0 && o < 2; ++o) {
        std::string text;
        for (int32_t d = 0; d < out[o].nbDims; ++d) {
            text += (d ? " " : "") + ExprBuilderImpl::textOf(*out[o].d[d]);
        }
        std::printf("OUTPUTSHAPE %d %s\n", o, text.c_str());
    }
    return rc;
}

// The build-time descriptors: dynamic dims are -1 in desc, min = opt = max = the case's dims.
void buildDescs(Case const& c, DataType const outTypes[2], int64_t attnLast,
                std::vector<DynamicPluginTensorDesc>* in, std::vector<DynamicPluginTensorDesc>* out) {
    in->assign(c.inputs.size(), DynamicPluginTensorDesc{});
    for (size_t i = 0; i < c.inputs.size(); ++i) {
        Tensor const& t = c.inputs[i];
        (*in)[i].desc.type = t.type;
        (*in)[i].desc.format = TensorFormat::kLINEAR;
        (*in)[i].desc.dims = t.dims;
        for (int32_t d = 0; d < t.dims.nbDims; ++d) {
            if (!t.symbols[d].empty()) (*in)[i].desc.dims.d[d] = -1;
        }
        (*in)[i].min = (*in)[i].opt = (*in)[i].max = t.dims;
    }
    Dims attn{};
    attn.nbDims = 3;
    attn.d[0] = c.inputs[0].dims.d[0];
    attn.d[1] = c.inputs[0].dims.d[1];
    attn.d[2] = attnLast;
    out->assign(2, DynamicPluginTensorDesc{});
    Dims const* dims[2] = {&attn, &c.inputs[1].dims};
    for (int32_t o = 0; o < 2; ++o) {
        (*out)[o].desc.type = outTypes[o];
        (*out)[o].desc.format = TensorFormat::kLINEAR;
        (*out)[o].desc.dims = *dims[o];
        (*out)[o].min = (*out)[o].opt = (*out)[o].max = *dims[o];
    }
}

// getFieldsToSerialize -> createPlugin(kRUNTIME) (engine deserialization), clone, then
// attachToContext (execution context creation). Returns the attached plugin.
std::unique_ptr<IPluginV3> runtimePlugin(IPluginCreatorV3One* creator, IPluginV3* plugin,
                                         IPluginV3OneRuntime* runtime) {
    std::map<std::string, std::string> const before = serializedFields(plugin);
    std::unique_ptr<IPluginV3> restored(
        creator->createPlugin("harness_node", runtime->getFieldsToSerialize(), TensorRTPhase::kRUNTIME));
    check(restored != nullptr, "createPlugin(kRUNTIME) from getFieldsToSerialize");
    if (restored != nullptr) {
        check(serializedFields(restored.get()) == before, "serialize round trip keeps every field");
    }
    std::unique_ptr<IPluginV3> cloned(plugin->clone());
    check(cloned != nullptr && serializedFields(cloned.get()) == before, "clone keeps every field");
    IPluginV3* base = restored != nullptr ? restored.get() : plugin;
    auto* baseRuntime = static_cast<IPluginV3OneRuntime*>(base->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    static ResourceContext context;
    std::unique_ptr<IPluginV3> attached(baseRuntime->attachToContext(&context));
    check(attached != nullptr && attached.get() != base, "attachToContext returns a new plugin");
    if (attached != nullptr) {
        check(serializedFields(attached.get()) == before, "attachToContext keeps every field");
    }
    return attached;
}

// onShapeChange + enqueue on host memory; writes attn_out.bin / present_kv_cache.bin.
int32_t enqueueOnHost(IPluginV3OneRuntime* exec, Case const& c, std::vector<DynamicPluginTensorDesc> const& in,
                      std::vector<DynamicPluginTensorDesc> const& out, size_t workspace, std::string const& outDir) {
    int32_t const nbInputs = static_cast<int32_t>(c.inputs.size());
    std::vector<PluginTensorDesc> inDesc(in.size()), outDesc(2);
    for (int32_t i = 0; i < nbInputs; ++i) {
        inDesc[i] = in[i].desc;
        inDesc[i].dims = c.inputs[i].dims;  // concrete at run time
    }
    outDesc[0] = out[0].desc;
    outDesc[1] = out[1].desc;
    std::printf("ONSHAPECHANGE %d\n", exec->onShapeChange(inDesc.data(), nbInputs, outDesc.data(), 2));
    std::vector<std::vector<uint8_t>> data;
    for (Tensor const& t : c.inputs) data.push_back(t.data);
    std::vector<void const*> inputs;
    for (auto& d : data) inputs.push_back(d.empty() ? nullptr : d.data());
    std::vector<uint8_t> attn(static_cast<size_t>(volume(outDesc[0].dims)) * dtypeBytes(outDesc[0].type), 0xab);
    std::vector<uint8_t> present;
    void* outputs[2] = {attn.empty() ? nullptr : attn.data(), const_cast<void*>(inputs[1])};
    if (!c.alias) {
        present.assign(data[1].size(), 0xcd);  // garbage: enqueue must carry the pool over
        outputs[1] = present.empty() ? nullptr : present.data();
    }
    std::vector<uint8_t> workspaceBytes(workspace + 1);
    int32_t const rc = exec->enqueue(inDesc.data(), outDesc.data(), inputs.data(), outputs,
                                     workspaceBytes.data(), nullptr);
    std::printf("ENQUEUE %d\n", rc);
    auto const write = [&](std::string const& name, void const* bytes, size_t n) {
        std::ofstream f(outDir + "/" + name, std::ios::binary);
        f.write(static_cast<char const*>(bytes), static_cast<std::streamsize>(n));
    };
    write("attn_out.bin", attn.data(), attn.size());
    write("present_kv_cache.bin", outputs[1], data[1].size());
    if (!c.alias) {
        check(data[1] == c.inputs[1].data, "enqueue without aliasing leaves kv_cache unchanged");
    }
    return rc;
}

int run(char const* libraryPath, char const* casePath, std::string const& outDir, bool doEnqueue) {
    Case const c = readCase(casePath);
    IPluginCreatorV3One* creator = loadCreator(libraryPath);
    if (creator == nullptr) return 1;
    // createPlugin(kBUILD) from the node's attributes, typed as the ONNX parser types them
    std::vector<PluginField> fields;
    for (FieldValue const& f : c.fields) fields.emplace_back(f.name.c_str(), f.bytes.data(), f.type, f.length);
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    std::unique_ptr<IPluginV3> plugin(creator->createPlugin("harness_node", &fc, TensorRTPhase::kBUILD));
    check(plugin != nullptr, "createPlugin(kBUILD)");
    if (plugin == nullptr) return 1;
    Interfaces const api = capabilities(plugin.get());
    if (api.build == nullptr) return 1;
    printSerialized(api.runtime);
    int32_t const nbInputs = static_cast<int32_t>(c.inputs.size());
    std::printf("NBOUTPUTS %d\n", api.build->getNbOutputs());
    if (api.build->getNbOutputs() != 2) return 1;
    formatCombinations(api.build, c);

    std::vector<DataType> inTypes;
    for (Tensor const& t : c.inputs) inTypes.push_back(t.type);
    DataType outTypes[2] = {DataType::kINT64, DataType::kINT64};
    int32_t const typesRc = api.build->getOutputDataTypes(outTypes, 2, inTypes.data(), nbInputs);
    std::printf("OUTPUTTYPES %d %s %s\n", typesRc, dtypeText(outTypes[0]).c_str(), dtypeText(outTypes[1]).c_str());
    DataType spare[2];
    check(api.build->getOutputDataTypes(spare, 2, inTypes.data(), nbInputs - 1) != 0,
          "getOutputDataTypes refuses a wrong input count");

    ExprBuilderImpl exprImpl;
    DimsExprs outExprs[2];
    int32_t const shapesRc = outputShapes(api.build, c, exprImpl, outExprs);
    bool const lastConstant = shapesRc == 0 && outExprs[0].d[2]->isConstant();
    std::vector<DynamicPluginTensorDesc> in, out;
    buildDescs(c, outTypes, lastConstant ? outExprs[0].d[2]->getConstantValue() : -1, &in, &out);
    int32_t const configureRc = api.build->configurePlugin(in.data(), nbInputs, out.data(), 2);
    std::printf("CONFIGURE %d\n", configureRc);
    size_t const workspace = api.build->getWorkspaceSize(in.data(), nbInputs, out.data(), 2);
    std::printf("WORKSPACE %zu\n", workspace);
    std::printf("ALIASED %d %d\n", api.build->getAliasedInput(0), api.build->getAliasedInput(1));

    std::unique_ptr<IPluginV3> attached = runtimePlugin(creator, plugin.get(), api.runtime);
    if (attached == nullptr) return 1;
    auto* exec = static_cast<IPluginV3OneRuntime*>(attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    int32_t const enqueueRc = doEnqueue ? enqueueOnHost(exec, c, in, out, workspace, outDir) : 0;
    bool const ok = gFailures == 0 && enqueueRc == 0 && configureRc == 0 && shapesRc == 0 && typesRc == 0;
    return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    bool const noEnqueue = argc == 5 && std::strcmp(argv[4], "--no-enqueue") == 0;
    if (argc != 4 && !noEnqueue) {
        std::fprintf(stderr, "usage: %s LIBRARY CASE_FILE OUT_DIR [--no-enqueue]\n", argv[0]);
        return 2;
    }
    try {
        return run(argv[1], argv[2], argv[3], !noEnqueue);
    } catch (std::exception const& e) {
        std::printf("CHECK FAIL harness %s\n", e.what());
        return 1;
    }
}
