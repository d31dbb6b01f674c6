/*
 * A stand-in libnvidia-ml.so.1 for driving the REAL pynvml (nvidia-ml-py) without a GPU.
 *
 * Why C and nvml.h: every struct and prototype here comes from the real header (the PyPI wheel
 * nvidia-nvml-dev-cu12, version in tests/support/stub_nvml/build.py), so when pynvml's ctypes
 * classes disagree with the header (a missing field, a wrong stride) the values it unmarshals are
 * wrong, as they would be over a real driver. A stub built from pynvml's own classes would agree
 * with them by construction and could not catch that.
 *
 * NVML_NO_UNVERSIONED_FUNC_DEFS makes the header declare the unversioned entry points (nvmlInit,
 * nvmlDeviceGetComputeRunningProcesses with nvmlProcessInfo_v1_t, ...) under their own symbol
 * names, as old callers link them, instead of #defining them to the _v2/_v3 names; the compiler
 * then checks each definition below against the header's prototype.
 *
 * Behaviour comes from a text layout named by $HYBRIDMON_STUB_NVML_LAYOUT, read at init (real NVML
 * enumerates GPUs at init too). build.py's write_layout() writes it from a dict; the format is:
 *   driver_version 550.54.15            (before the first "gpu": system-wide lines)
 *   fail <nvmlFunction> <nvmlReturn_t>  (system-wide: that function returns the code)
 *   gpu                                 (starts the next GPU; the lines after it describe it)
 *   name / uuid / bus_id <text>         memory_total / memory_reserved / memory_used <bytes>
 *   pcie_rx_kbps / pcie_tx_kbps / link_gen / link_gen_max / link_width / link_width_max /
 *   replays / util_gpu / util_memory / numa_node / mig_current / mig_pending <number>
 *   pci_device_id / pci_subsystem_id <number, 0x allowed>   cpu_affinity <word> [<word> ...]
 *   field <fieldId> <unsigned long long>   (fields not listed answer NOT_SUPPORTED per value)
 *   c2c_mode <0|1>                      (isC2cEnabled; without it C2C mode info is NOT_SUPPORTED)
 *   c2c_link <up 0|1> <MBps>            (one per link: fields 171/172 with the link as scopeId)
 *   gpm_supported <0|1>   gpm_metric <nvmlGpmMetricId_t> <value, e.g. MiB/s>
 *   process <compute|graphics|mps> <pid> <used bytes|na> <name>
 *   fail <nvmlFunction> <nvmlReturn_t>  (on this GPU only)
 *
 * Build variants (build.py): -DHYBRIDMON_STUB_NO_V3 leaves out the *RunningProcesses_v3 symbols and
 * -DHYBRIDMON_STUB_NO_MEMORY_V2 leaves out nvmlDeviceGetMemoryInfo_v2, as drivers older than those
 * entry points lack them; pynvml then raises NVMLError_FunctionNotFound (or, for the unversioned
 * process wrappers, NVMLLibraryMismatchError), as on such a driver.
 *
 *   pcie_window_us <µs>                 (system-wide: nvmlDeviceGetPcieThroughput blocks this long)
 *
 *   pcie_counters_advance 1             (per GPU: its PCIe byte counter fields, 197 TX and 198 RX,
 *                                        grow from their layout value at pcie_tx_kbps / pcie_rx_kbps)
 *
 * Simplifications (documented, not hidden): values are static between calls (counters do not
 * advance but where pcie_counters_advance says so, a GPM metric answers its layout value over any two samples); nvmlDeviceGetPcieThroughput
 * blocks for its 20 ms window only where the layout says pcie_window_us 20000 (the daemon
 * benchmark's --nvml stub does; the tests' probes leave it out, at 20 ms a call they would add
 * seconds to the suite);
 * nvmlDeviceSetCpuAffinity answers SUCCESS without binding the caller.
 */
#include "stub_state.h"

static int init_count;

/* ---- the common entry checks -------------------------------------------------------------------- */
static nvmlReturn_t scripted_failure(const char *function, const struct nvmlDevice_st *gpu)
{
    for (unsigned int i = 0; i < system_fail_count; i++) {
        if (strcmp(system_fails[i].function, function) == 0) {
            return system_fails[i].code;
        }
    }
    for (unsigned int i = 0; gpu != NULL && i < gpu->fail_count; i++) {
        if (strcmp(gpu->fails[i].function, function) == 0) {
            return gpu->fails[i].code;
        }
    }
    return NVML_SUCCESS;
}

/* What every device call checks first, in NVML's order: initialised, valid handle, scripted. */
static nvmlReturn_t enter_device(const char *function, nvmlDevice_t device)
{
    count_call(function);
    if (init_count == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (device == NULL || device < gpus || device >= gpus + gpu_count) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return scripted_failure(function, device);
}

static nvmlReturn_t enter_system(const char *function)
{
    count_call(function);
    if (init_count == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    return scripted_failure(function, NULL);
}

static nvmlReturn_t copy_text(char *out, unsigned int length, const char *text)
{
    if (out == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (strlen(text) + 1 > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(out, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

#define ENTER_DEVICE(device)                                   \
    do {                                                       \
        nvmlReturn_t entered = enter_device(__func__, device); \
        if (entered != NVML_SUCCESS) {                         \
            return entered;                                    \
        }                                                      \
    } while (0)

#define ENTER_SYSTEM()                                   \
    do {                                                 \
        nvmlReturn_t entered = enter_system(__func__);   \
        if (entered != NVML_SUCCESS) {                   \
            return entered;                              \
        }                                                \
    } while (0)

#define REQUIRE(pointer)                           \
    do {                                           \
        if ((pointer) == NULL) {                   \
            return NVML_ERROR_INVALID_ARGUMENT;    \
        }                                          \
    } while (0)

/* ---- lifecycle and system ----------------------------------------------------------------------- */
static nvmlReturn_t init_from_layout(const char *function)
{
    nvmlReturn_t scripted;

    count_call(function);
    if (load_layout() != 0) {
        return NVML_ERROR_UNKNOWN;
    }
    scripted = scripted_failure(function, NULL);
    if (scripted != NVML_SUCCESS) {
        return scripted;
    }
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return init_from_layout(__func__);
}

nvmlReturn_t nvmlInit_v2(void) { return init_from_layout(__func__); }
nvmlReturn_t nvmlInit(void) { return init_from_layout(__func__); }

nvmlReturn_t nvmlShutdown(void)
{
    count_call(__func__);
    if (init_count == 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    init_count--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER_SYSTEM();
    return copy_text(version, length, driver_version);
}

nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    ENTER_SYSTEM();
    for (unsigned int g = 0; g < gpu_count; g++) {
        for (unsigned int p = 0; p < gpus[g].process_count; p++) {
            if (gpus[g].processes[p].pid == pid) {
                return copy_text(name, length, gpus[g].processes[p].name);
            }
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    ENTER_SYSTEM();
    REQUIRE(deviceCount);
    *deviceCount = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    ENTER_SYSTEM();
    REQUIRE(device);
    if (index >= gpu_count) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *device = &gpus[index];
    return scripted_failure(__func__, &gpus[index]);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

/* ---- identity ----------------------------------------------------------------------------------- */
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER_DEVICE(device);
    return copy_text(name, length, device->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    ENTER_DEVICE(device);
    return copy_text(uuid, length, device->uuid);
}

static nvmlReturn_t fill_pci_info(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    unsigned int domain = 0, bus = 0, slot = 0, function = 0;

    REQUIRE(pci);
    memset(pci, 0, sizeof *pci);
    sscanf(device->bus_id, "%x:%x:%x.%x", &domain, &bus, &slot, &function);
    /* busIdLegacy is the old 16-byte form, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT "%04X:%02X:%02X.0". */
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT,
             domain, bus, slot);
    snprintf(pci->busId, sizeof pci->busId, "%s", device->bus_id);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = slot;
    pci->pciDeviceId = device->pci_device_id;
    pci->pciSubSystemId = device->pci_subsystem_id;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER_DEVICE(device);
    return fill_pci_info(device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER_DEVICE(device);
    return fill_pci_info(device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER_DEVICE(device);
    return fill_pci_info(device, pci);
}

/* ---- memory ------------------------------------------------------------------------------------- */
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    ENTER_DEVICE(device);
    REQUIRE(memory);
    /* nvml.h: v1 `used` is the "Sum of Reserved and Allocated device memory". */
    memory->total = device->memory_total;
    memory->used = device->memory_used + device->memory_reserved;
    memory->free = device->memory_total - memory->used;
    return NVML_SUCCESS;
}

#ifndef HYBRIDMON_STUB_NO_MEMORY_V2
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    ENTER_DEVICE(device);
    REQUIRE(memory);
    /* The caller stamps the struct version (nvml.h: nvmlMemory_v2 = NVML_STRUCT_VERSION(Memory, 2)). */
    if (memory->version != nvmlMemory_v2) {
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    memory->total = device->memory_total;
    memory->reserved = device->memory_reserved;
    memory->used = device->memory_used;
    memory->free = device->memory_total - device->memory_reserved - device->memory_used;
    return NVML_SUCCESS;
}
#endif

/* ---- PCIe, utilization, NUMA, MIG, affinity ---------------------------------------------------------- */
nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, nvmlPcieUtilCounter_t counter,
                                         unsigned int *value)
{
    ENTER_DEVICE(device);
    REQUIRE(value);
    if (pcie_window_us > 0) {
        /* nvml.h: "querying a byte counter over a 20ms interval". A sleep, so the caller's
         * thread waits without burning CPU; ctypes released the GIL before the call. Whether the
         * real driver waits the same way (sleeping, not spinning) only a GPU can settle: an
         * assumption, docs/nvml-cost.md. */
        struct timespec window = {pcie_window_us / 1000000, (long)(pcie_window_us % 1000000) * 1000};
        while (nanosleep(&window, &window) != 0 && errno == EINTR) {
        }
    }
    if (counter == NVML_PCIE_UTIL_TX_BYTES) {
        *value = device->pcie_tx_kbps;
    } else if (counter == NVML_PCIE_UTIL_RX_BYTES) {
        *value = device->pcie_rx_kbps;
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

#define UINT_GETTER(function, member)                                 \
    nvmlReturn_t function(nvmlDevice_t device, unsigned int *value)   \
    {                                                                 \
        ENTER_DEVICE(device);                                         \
        REQUIRE(value);                                               \
        *value = device->member;                                      \
        return NVML_SUCCESS;                                          \
    }

UINT_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, link_gen)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, link_gen_max)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkWidth, link_width)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkWidth, link_width_max)
UINT_GETTER(nvmlDeviceGetPcieReplayCounter, replays)
UINT_GETTER(nvmlDeviceGetNumaNodeId, numa_node)

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    ENTER_DEVICE(device);
    REQUIRE(utilization);
    utilization->gpu = device->util_gpu;
    utilization->memory = device->util_memory;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                  unsigned int *pendingMode)
{
    ENTER_DEVICE(device);
    REQUIRE(currentMode);
    REQUIRE(pendingMode);
    *currentMode = device->mig_current;
    *pendingMode = device->mig_pending;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                      unsigned long *cpuSet)
{
    ENTER_DEVICE(device);
    REQUIRE(cpuSet);
    for (unsigned int i = 0; i < cpuSetSize; i++) {
        cpuSet[i] = i < device->cpu_affinity_words ? device->cpu_affinity[i] : 0;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetCpuAffinity(nvmlDevice_t device)
{
    ENTER_DEVICE(device);
    return NVML_SUCCESS;
}

/* ---- field values ------------------------------------------------------------------------------- */
/*
 * NVLink-C2C fields, where the GPU has C2C mode info: the link count, then per link (scopeId) its
 * status and "C2C Link Speed in MBps" (nvml.h). Assumptions, not in nvml.h: the link is given in
 * scopeId (the header says so for the NVLink fields only), the count and status are unsigned int
 * and the speed unsigned long long. 1 when the field was a C2C one.
 */
static int c2c_field(const struct nvmlDevice_st *device, nvmlFieldValue_t *value)
{
    if (device->c2c_mode < 0 || (value->fieldId != NVML_FI_DEV_C2C_LINK_COUNT
                                 && value->fieldId != NVML_FI_DEV_C2C_LINK_GET_STATUS
                                 && value->fieldId != NVML_FI_DEV_C2C_LINK_GET_MAX_BW)) {
        return 0;
    }
    if (value->fieldId == NVML_FI_DEV_C2C_LINK_COUNT) {
        value->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        value->value.uiVal = device->c2c_link_count;
    } else if (value->scopeId >= device->c2c_link_count) {
        value->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        return 1;
    } else if (value->fieldId == NVML_FI_DEV_C2C_LINK_GET_STATUS) {
        value->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        value->value.uiVal = device->c2c_links[value->scopeId].up;
    } else {
        value->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
        value->value.ullVal = device->c2c_links[value->scopeId].max_mbps;
    }
    value->nvmlReturn = NVML_SUCCESS;
    return 1;
}

/* A PCIe byte counter field (nvml.h: NVML_FI_DEV_PCIE_COUNT_TX_BYTES 197, _RX_BYTES 198, "Value
 * can be wrapped") as the device's layout rate moves it: its layout value plus kB/s x 1000 x the
 * seconds since the first call (an unsigned long long wraps as the driver's may). */
static unsigned long long advanced_counter(const struct nvmlDevice_st *device, const struct stub_field *field)
{
    static struct timespec since;
    struct timespec now;
    unsigned int kbps;

    if (!device->pcie_counters_advance || (field->id != 197 && field->id != 198)) {
        return field->value;
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (since.tv_sec == 0 && since.tv_nsec == 0) {
        since = now;
    }
    kbps = field->id == 197 ? device->pcie_tx_kbps : device->pcie_rx_kbps;
    return field->value + (unsigned long long)((double)kbps * 1000.0
        * ((double)(now.tv_sec - since.tv_sec) + (double)(now.tv_nsec - since.tv_nsec) / 1e9));
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    struct timeval now;

    ENTER_DEVICE(device);
    REQUIRE(values);
    gettimeofday(&now, NULL);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *value = &values[i];
        value->timestamp = (long long)now.tv_sec * 1000000 + now.tv_usec;
        value->latencyUsec = 0;
        value->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        if (c2c_field(device, value)) {
            continue;
        }
        for (unsigned int f = 0; f < device->field_count; f++) {
            if (device->fields[f].id == value->fieldId) {
                /* Assumed type: nvml.h does not say which valueType the PCIe byte counters use. */
                value->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
                value->value.ullVal = advanced_counter(device, &device->fields[f]);
                value->nvmlReturn = NVML_SUCCESS;
            }
        }
    }
    return NVML_SUCCESS;
}

/* ---- NVLink-C2C mode and GPM ------------------------------------------------------------------- */
nvmlReturn_t nvmlDeviceGetC2cModeInfoV(nvmlDevice_t device, nvmlC2cModeInfo_v1_t *c2cModeInfo)
{
    ENTER_DEVICE(device);
    REQUIRE(c2cModeInfo);
    if (device->c2c_mode < 0) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    c2cModeInfo->isC2cEnabled = (unsigned int)device->c2c_mode;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *gpmSupport)
{
    ENTER_DEVICE(device);
    REQUIRE(gpmSupport);
    if (gpmSupport->version != NVML_GPM_SUPPORT_VERSION) {
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;  /* assumed: nvml.h says "IN: Set to" it */
    }
    gpmSupport->isSupportedDevice = device->gpm_supported;
    return NVML_SUCCESS;
}

/* nvml.h declares the sample only as an opaque `struct nvmlGpmSample_st *`. */
struct nvmlGpmSample_st {
    nvmlDevice_t device;   /* NULL until nvmlGpmSampleGet fills it */
    long long taken_usec;
};

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample)
{
    count_call(__func__);
    REQUIRE(gpmSample);
    *gpmSample = calloc(1, sizeof **gpmSample);
    return *gpmSample == NULL ? NVML_ERROR_MEMORY : NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t gpmSample)
{
    count_call(__func__);
    REQUIRE(gpmSample);
    free(gpmSample);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample)
{
    struct timeval now;

    ENTER_DEVICE(device);
    REQUIRE(gpmSample);
    if (!device->gpm_supported) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    gettimeofday(&now, NULL);
    gpmSample->device = device;
    gpmSample->taken_usec = (long long)now.tv_sec * 1000000 + now.tv_usec;
    return NVML_SUCCESS;
}

/*
 * Each metric the layout lists answers its value over any two samples of the same GPU, the later
 * one second; others NOT_SUPPORTED per metric. numMetrics is bounded by this header's
 * NVML_GPM_METRIC_MAX (pynvml's array may be longer: the driver reads numMetrics entries only, an
 * assumption a GPU would settle).
 */
nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)
{
    count_call(__func__);
    REQUIRE(metricsGet);
    if (metricsGet->version != NVML_GPM_METRICS_GET_VERSION) {
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    if (metricsGet->numMetrics > NVML_GPM_METRIC_MAX || metricsGet->sample1 == NULL
        || metricsGet->sample2 == NULL || metricsGet->sample1->device == NULL
        || metricsGet->sample1->device != metricsGet->sample2->device
        || metricsGet->sample2->taken_usec <= metricsGet->sample1->taken_usec) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    for (unsigned int i = 0; i < metricsGet->numMetrics; i++) {
        nvmlGpmMetric_t *metric = &metricsGet->metrics[i];
        const struct nvmlDevice_st *device = metricsGet->sample1->device;
        metric->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        for (unsigned int m = 0; m < device->gpm_metric_count; m++) {
            if (device->gpm_metrics[m].id == metric->metricId) {
                metric->value = device->gpm_metrics[m].value;
                metric->nvmlReturn = NVML_SUCCESS;
            }
        }
    }
    return NVML_SUCCESS;
}

/* ---- processes ---------------------------------------------------------------------------------- */
/*
 * NVML's protocol (nvml.h, nvmlDeviceGetComputeRunningProcesses_v3): with *infoCount smaller than
 * the list, answer INSUFFICIENT_SIZE and the count needed (infos may be NULL); SUCCESS with 0 when
 * there are none; otherwise fill and set *infoCount. Each version writes its own struct type, so
 * the stride is the header's sizeof for that version.
 */
#define PROCESS_LISTER(function, kind_name, info_type, has_instances)                            \
    nvmlReturn_t function(nvmlDevice_t device, unsigned int *infoCount, info_type *infos)        \
    {                                                                                            \
        unsigned int found = 0;                                                                  \
        ENTER_DEVICE(device);                                                                    \
        REQUIRE(infoCount);                                                                      \
        for (unsigned int p = 0; p < device->process_count; p++) {                               \
            found += strcmp(device->processes[p].kind, kind_name) == 0;                          \
        }                                                                                        \
        if (found == 0) {                                                                        \
            *infoCount = 0;                                                                      \
            return NVML_SUCCESS;                                                                 \
        }                                                                                        \
        if (*infoCount < found) {                                                                \
            *infoCount = found;                                                                  \
            return NVML_ERROR_INSUFFICIENT_SIZE;                                                 \
        }                                                                                        \
        REQUIRE(infos);                                                                          \
        found = 0;                                                                               \
        for (unsigned int p = 0; p < device->process_count; p++) {                               \
            const struct stub_process *process = &device->processes[p];                         \
            info_type *info;                                                                     \
            if (strcmp(process->kind, kind_name) != 0) {                                         \
                continue;                                                                        \
            }                                                                                    \
            info = &infos[found++];                                                              \
            memset(info, 0, sizeof *info);                                                       \
            info->pid = process->pid;                                                            \
            info->usedGpuMemory = process->used;                                                 \
            has_instances(info, device);                                                         \
        }                                                                                        \
        *infoCount = found;                                                                      \
        return NVML_SUCCESS;                                                                     \
    }

/* nvml.h: gpuInstanceId/computeInstanceId are 0xFFFFFFFF unless MIG is enabled. */
#define WITH_INSTANCES(info, device)                                   \
    do {                                                               \
        (info)->gpuInstanceId = (device)->mig_current ? 0 : 0xFFFFFFFFu;     \
        (info)->computeInstanceId = (device)->mig_current ? 0 : 0xFFFFFFFFu; \
    } while (0)
#define WITHOUT_INSTANCES(info, device) ((void)(info), (void)(device))

PROCESS_LISTER(nvmlDeviceGetComputeRunningProcesses, "compute", nvmlProcessInfo_v1_t, WITHOUT_INSTANCES)
PROCESS_LISTER(nvmlDeviceGetComputeRunningProcesses_v2, "compute", nvmlProcessInfo_v2_t, WITH_INSTANCES)
PROCESS_LISTER(nvmlDeviceGetGraphicsRunningProcesses, "graphics", nvmlProcessInfo_v1_t, WITHOUT_INSTANCES)
PROCESS_LISTER(nvmlDeviceGetGraphicsRunningProcesses_v2, "graphics", nvmlProcessInfo_v2_t, WITH_INSTANCES)
PROCESS_LISTER(nvmlDeviceGetMPSComputeRunningProcesses, "mps", nvmlProcessInfo_v1_t, WITHOUT_INSTANCES)
PROCESS_LISTER(nvmlDeviceGetMPSComputeRunningProcesses_v2, "mps", nvmlProcessInfo_v2_t, WITH_INSTANCES)
#ifndef HYBRIDMON_STUB_NO_V3
PROCESS_LISTER(nvmlDeviceGetComputeRunningProcesses_v3, "compute", nvmlProcessInfo_t, WITH_INSTANCES)
PROCESS_LISTER(nvmlDeviceGetGraphicsRunningProcesses_v3, "graphics", nvmlProcessInfo_t, WITH_INSTANCES)
PROCESS_LISTER(nvmlDeviceGetMPSComputeRunningProcesses_v3, "mps", nvmlProcessInfo_t, WITH_INSTANCES)
#endif
