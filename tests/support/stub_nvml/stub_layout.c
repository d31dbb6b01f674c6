/*
 * The stub libnvidia-ml's layout file ($HYBRIDMON_STUB_NVML_LAYOUT; format in stub_nvml.c) and its
 * per-entry-point call counts.
 */
#include "stub_state.h"

struct nvmlDevice_st gpus[STUB_MAX_GPUS];
unsigned int gpu_count;
char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = "550.54.15";
unsigned int pcie_window_us;
struct stub_fail system_fails[STUB_MAX_FAILS];
unsigned int system_fail_count;

/* ---- calls counted per entry point, so a test can tell which version pynvml reached ---------- */
#define STUB_MAX_COUNTED 128
static struct { char function[80]; unsigned long calls; } counted[STUB_MAX_COUNTED];
/* ctypes drops the GIL around foreign calls, so the collector's per-GPU threads really overlap. */
static pthread_mutex_t counted_lock = PTHREAD_MUTEX_INITIALIZER;

void count_call(const char *function)
{
    pthread_mutex_lock(&counted_lock);
    for (unsigned int i = 0; i < STUB_MAX_COUNTED; i++) {
        if (counted[i].function[0] == '\0') {
            snprintf(counted[i].function, sizeof counted[i].function, "%s", function);
        }
        if (strcmp(counted[i].function, function) == 0) {
            counted[i].calls++;
            break;
        }
    }
    pthread_mutex_unlock(&counted_lock);
}

/* Not an NVML entry point: how often `function` was called since the library was loaded. */
unsigned long hybridmon_stub_calls(const char *function)
{
    unsigned long calls = 0;

    pthread_mutex_lock(&counted_lock);
    for (unsigned int i = 0; i < STUB_MAX_COUNTED && counted[i].function[0]; i++) {
        if (strcmp(counted[i].function, function) == 0) {
            calls = counted[i].calls;
            break;
        }
    }
    pthread_mutex_unlock(&counted_lock);
    return calls;
}

/* ---- the layout ------------------------------------------------------------------------------ */
static int add_fail(struct stub_fail *fails, unsigned int *count, const char *function, long code)
{
    if (*count >= STUB_MAX_FAILS) {
        return -1;
    }
    snprintf(fails[*count].function, sizeof fails[*count].function, "%s", function);
    fails[*count].code = (nvmlReturn_t)code;
    (*count)++;
    return 0;
}

static int parse_process(struct nvmlDevice_st *gpu, const char *rest)
{
    struct stub_process *process;
    char used[32];
    int consumed = 0;

    if (gpu->process_count >= STUB_MAX_PROCESSES) {
        return -1;
    }
    process = &gpu->processes[gpu->process_count];
    if (sscanf(rest, "%15s %u %31s %n", process->kind, &process->pid, used, &consumed) != 3) {
        return -1;
    }
    if (strcmp(process->kind, "compute") && strcmp(process->kind, "graphics")
        && strcmp(process->kind, "mps")) {
        return -1;
    }
    process->used = strcmp(used, "na") == 0 ? (unsigned long long)NVML_VALUE_NOT_AVAILABLE
                                            : strtoull(used, NULL, 0);
    snprintf(process->name, sizeof process->name, "%s", rest + consumed);
    gpu->process_count++;
    return 0;
}

static int parse_gpu_line(struct nvmlDevice_st *gpu, const char *key, const char *rest)
{
    static const struct { const char *key; size_t offset; } numbers[] = {
        {"pcie_rx_kbps", offsetof(struct nvmlDevice_st, pcie_rx_kbps)},
        {"pcie_tx_kbps", offsetof(struct nvmlDevice_st, pcie_tx_kbps)},
        {"link_gen", offsetof(struct nvmlDevice_st, link_gen)},
        {"link_gen_max", offsetof(struct nvmlDevice_st, link_gen_max)},
        {"link_width", offsetof(struct nvmlDevice_st, link_width)},
        {"link_width_max", offsetof(struct nvmlDevice_st, link_width_max)},
        {"replays", offsetof(struct nvmlDevice_st, replays)},
        {"util_gpu", offsetof(struct nvmlDevice_st, util_gpu)},
        {"util_memory", offsetof(struct nvmlDevice_st, util_memory)},
        {"numa_node", offsetof(struct nvmlDevice_st, numa_node)},
        {"mig_current", offsetof(struct nvmlDevice_st, mig_current)},
        {"mig_pending", offsetof(struct nvmlDevice_st, mig_pending)},
        {"pci_device_id", offsetof(struct nvmlDevice_st, pci_device_id)},
        {"pci_subsystem_id", offsetof(struct nvmlDevice_st, pci_subsystem_id)},
        {"gpm_supported", offsetof(struct nvmlDevice_st, gpm_supported)},
    };
    static const struct { const char *key; size_t offset; } sizes[] = {
        {"memory_total", offsetof(struct nvmlDevice_st, memory_total)},
        {"memory_reserved", offsetof(struct nvmlDevice_st, memory_reserved)},
        {"memory_used", offsetof(struct nvmlDevice_st, memory_used)},
    };
    char function[80];
    long code;

    for (size_t i = 0; i < sizeof numbers / sizeof numbers[0]; i++) {
        if (strcmp(key, numbers[i].key) == 0) {
            *(unsigned int *)((char *)gpu + numbers[i].offset) = (unsigned int)strtoul(rest, NULL, 0);
            return 0;
        }
    }
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (strcmp(key, sizes[i].key) == 0) {
            *(unsigned long long *)((char *)gpu + sizes[i].offset) = strtoull(rest, NULL, 0);
            return 0;
        }
    }
    if (strcmp(key, "name") == 0) {
        snprintf(gpu->name, sizeof gpu->name, "%s", rest);
    } else if (strcmp(key, "uuid") == 0) {
        snprintf(gpu->uuid, sizeof gpu->uuid, "%s", rest);
    } else if (strcmp(key, "bus_id") == 0) {
        snprintf(gpu->bus_id, sizeof gpu->bus_id, "%s", rest);
    } else if (strcmp(key, "process") == 0) {
        return parse_process(gpu, rest);
    } else if (strcmp(key, "field") == 0) {
        struct stub_field *field = &gpu->fields[gpu->field_count];
        if (gpu->field_count >= STUB_MAX_FIELDS
            || sscanf(rest, "%u %llu", &field->id, &field->value) != 2) {
            return -1;
        }
        gpu->field_count++;
    } else if (strcmp(key, "pcie_counters_advance") == 0) {
        gpu->pcie_counters_advance = (int)strtol(rest, NULL, 0);
    } else if (strcmp(key, "c2c_mode") == 0) {
        gpu->c2c_mode = (int)strtol(rest, NULL, 0);
    } else if (strcmp(key, "c2c_link") == 0) {
        struct stub_c2c_link *link = &gpu->c2c_links[gpu->c2c_link_count];
        if (gpu->c2c_link_count >= STUB_MAX_C2C_LINKS
            || sscanf(rest, "%u %llu", &link->up, &link->max_mbps) != 2) {
            return -1;
        }
        gpu->c2c_link_count++;
    } else if (strcmp(key, "gpm_metric") == 0) {
        struct stub_gpm_metric *metric = &gpu->gpm_metrics[gpu->gpm_metric_count];
        if (gpu->gpm_metric_count >= STUB_MAX_GPM_METRICS
            || sscanf(rest, "%u %lf", &metric->id, &metric->value) != 2) {
            return -1;
        }
        gpu->gpm_metric_count++;
    } else if (strcmp(key, "cpu_affinity") == 0) {
        char *end;
        const char *at = rest;
        gpu->cpu_affinity_words = 0;
        while (gpu->cpu_affinity_words < STUB_MAX_AFFINITY_WORDS) {
            unsigned long word = strtoul(at, &end, 0);
            if (end == at) {
                break;
            }
            gpu->cpu_affinity[gpu->cpu_affinity_words++] = word;
            at = end;
        }
    } else if (strcmp(key, "fail") == 0) {
        if (sscanf(rest, "%79s %ld", function, &code) != 2) {
            return -1;
        }
        return add_fail(gpu->fails, &gpu->fail_count, function, code);
    } else {
        return -1;
    }
    return 0;
}

/* Reads the layout; on a bad line says which on stderr and returns -1 (init then fails). */
int load_layout(void)
{
    const char *path = getenv("HYBRIDMON_STUB_NVML_LAYOUT");
    char line[512], key[64], function[80];
    unsigned int line_number = 0;
    struct nvmlDevice_st *gpu = NULL;
    long code;
    FILE *file;

    gpu_count = 0;
    system_fail_count = 0;
    memset(gpus, 0, sizeof gpus);
    if (path == NULL) {
        fprintf(stderr, "stub libnvidia-ml: HYBRIDMON_STUB_NVML_LAYOUT is not set\n");
        return -1;
    }
    file = fopen(path, "r");
    if (file == NULL) {
        fprintf(stderr, "stub libnvidia-ml: cannot read layout %s\n", path);
        return -1;
    }
    while (fgets(line, sizeof line, file) != NULL) {
        int consumed = 0;
        const char *rest;
        int bad = 0;

        line_number++;
        line[strcspn(line, "\n")] = '\0';
        if (sscanf(line, "%63s %n", key, &consumed) != 1 || key[0] == '#') {
            continue;
        }
        rest = line + consumed;
        if (strcmp(key, "gpu") == 0) {
            if (gpu_count >= STUB_MAX_GPUS) {
                bad = 1;
            } else {
                gpu = &gpus[gpu_count];
                gpu->index = gpu_count++;
                gpu->c2c_mode = -1;  /* no C2C unless the layout says (x86 PCIe hosts) */
            }
        } else if (gpu != NULL) {
            bad = parse_gpu_line(gpu, key, rest) != 0;
        } else if (strcmp(key, "driver_version") == 0) {
            snprintf(driver_version, sizeof driver_version, "%s", rest);
        } else if (strcmp(key, "pcie_window_us") == 0) {
            pcie_window_us = (unsigned int)strtoul(rest, NULL, 0);
        } else if (strcmp(key, "fail") == 0) {
            bad = sscanf(rest, "%79s %ld", function, &code) != 2
                  || add_fail(system_fails, &system_fail_count, function, code) != 0;
        } else {
            bad = 1;
        }
        if (bad) {
            fprintf(stderr, "stub libnvidia-ml: %s line %u not understood: %s\n", path,
                    line_number, line);
            fclose(file);
            return -1;
        }
    }
    fclose(file);
    return 0;
}
