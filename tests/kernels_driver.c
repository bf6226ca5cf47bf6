/* The C kernels' entry points (kernels.h) driven without Python, for a build for another CPU run under
 * emulation (tests/test_kernels_portable.py): reads the cases a test wrote, runs each, writes what each
 * gave. Usage: kernels_driver CASES RESULTS.
 *
 * CASES (little-endian int64 fields, float32 values, bytes as they are): the number of threads; the
 * eight i-quant tables (k3_set_iq_grids), each its length and bytes; the number of cases, then each:
 * - 0 (a matrix): GGML type, output rows, input features, row bytes, input rows n; the weight's bytes;
 *   x [n, input features]. Results: k3_decode_row of the whole matrix, then k3_grouped_product on float
 *   activations and on 8-bit ones (x's rows in order).
 * - 1 (routed experts): GGML type, input features, hidden, experts, pairs, input rows, row bytes of
 *   gate and up, of down; beta and linear_beta (float32); starts [experts + 1], rows [pairs]; gate, up
 *   ([experts, hidden, input features]) and down ([experts, input features, hidden]) weights' bytes; x.
 *   Results: k3_expert_mlp on float activations and on 8-bit ones.
 * RESULTS: per result its status, its number of values (none where the status is not 0), the values. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../src/k3stream/quant/kernels/kernels.h"

static FILE *cases, *results;

static void fail(const char *what) {
    fprintf(stderr, "kernels_driver: %s\n", what);
    exit(2);
}

static void *read_bytes(size_t bytes) {
    void *block = calloc(bytes + 1, 1);
    if (block == NULL) fail("out of memory");
    if (bytes > 0 && fread(block, 1, bytes, cases) != bytes) fail("the cases end early");
    return block;
}

static int64_t read_number(void) {
    int64_t *value = read_bytes(sizeof(int64_t)), held = *value;
    free(value);
    return held;
}

static void put(int64_t status, const float *values, int64_t count) {
    if (status != 0) count = 0;
    const int64_t head[2] = {status, count};
    if (fwrite(head, sizeof head, 1, results) != 1 ||
        (count > 0 && fwrite(values, sizeof(float), (size_t)count, results) != (size_t)count))
        fail("cannot write the results");
}

/* a case of one matrix (kind 0, above) */
static void matrix_case(int threads) {
    const int type = (int)read_number();
    const int64_t out_rows = read_number(), in_features = read_number(), row_bytes = read_number(), n = read_number();
    uint8_t *weight = read_bytes((size_t)(out_rows * row_bytes));
    float *x = read_bytes(sizeof(float) * (size_t)(n * in_features));
    float *decoded = calloc((size_t)(out_rows * in_features) + 1, sizeof(float));
    float *out = calloc((size_t)(n * out_rows) + 1, sizeof(float));
    int64_t *rows = calloc((size_t)n + 1, sizeof(int64_t));
    if (decoded == NULL || out == NULL || rows == NULL) fail("out of memory");
    put(k3_decode_row(type, weight, out_rows * in_features, decoded), decoded, out_rows * in_features);
    for (int64_t p = 0; p < n; p++) rows[p] = p;
    const int64_t address = (int64_t)(uintptr_t)weight, starts[2] = {0, n};
    for (int q8 = 0; q8 < 2; q8++) {
        const int status =
            k3_grouped_product(x, in_features, &address, 1, out_rows, row_bytes, type, starts, rows, out, threads, q8);
        put(status, out, n * out_rows);
    }
    free(weight), free(x), free(decoded), free(out), free(rows);
}

/* a role's matrices, `experts` of `bytes` each, from one buffer: their addresses into `addresses` */
static Role role(int type, uint8_t *matrices, int64_t experts, int64_t out_rows, int64_t row_bytes,
                 int64_t *addresses) {
    for (int64_t b = 0; b < experts; b++) addresses[b] = (int64_t)(uintptr_t)(matrices + b * out_rows * row_bytes);
    return (Role){addresses, type, out_rows, row_bytes};
}

/* a case of routed experts (kind 1, above) */
static void experts_case(int threads) {
    const int type = (int)read_number();
    const int64_t in_features = read_number(), hidden = read_number(), experts = read_number(), pairs = read_number();
    const int64_t x_rows = read_number(), in_bytes = read_number(), hidden_bytes = read_number();
    float *betas = read_bytes(2 * sizeof(float));
    int64_t *starts = read_bytes(sizeof(int64_t) * (size_t)(experts + 1)), *rows = read_bytes(sizeof(int64_t) * (size_t)pairs);
    uint8_t *gate = read_bytes((size_t)(experts * hidden * in_bytes)), *up = read_bytes((size_t)(experts * hidden * in_bytes));
    uint8_t *down = read_bytes((size_t)(experts * in_features * hidden_bytes));
    float *x = read_bytes(sizeof(float) * (size_t)(x_rows * in_features));
    float *out = calloc((size_t)(pairs * in_features) + 1, sizeof(float));
    int64_t *addresses = calloc(3 * (size_t)experts + 1, sizeof(int64_t));
    if (out == NULL || addresses == NULL) fail("out of memory");
    const Role gates = role(type, gate, experts, hidden, in_bytes, addresses);
    const Role ups = role(type, up, experts, hidden, in_bytes, addresses + experts);
    const Role downs = role(type, down, experts, in_features, hidden_bytes, addresses + 2 * experts);
    for (int q8 = 0; q8 < 2; q8++) {
        const int status = k3_expert_mlp(x, in_features, gates, ups, downs, experts, starts, rows, betas[0], betas[1],
                                         out, threads, q8);
        put(status, out, pairs * in_features);
    }
    free(betas), free(starts), free(rows), free(gate), free(up), free(down), free(x), free(out), free(addresses);
}

int main(int argc, char **argv) {
    if (argc != 3) fail("usage: kernels_driver CASES RESULTS");
    if ((cases = fopen(argv[1], "rb")) == NULL) fail("cannot open the cases");
    if ((results = fopen(argv[2], "wb")) == NULL) fail("cannot open the results");
    const int threads = (int)read_number();
    const void *tables[IQ_TABLES];
    int64_t bytes[IQ_TABLES], expected;
    for (int i = 0; i < IQ_TABLES; i++) tables[i] = read_bytes((size_t)(bytes[i] = read_number()));
    if (k3_set_iq_grids(tables, bytes, &expected) >= 0) fail("an i-quant table of the wrong size");
    for (int i = 0; i < IQ_TABLES; i++) free((void *)tables[i]);
    printf("%s\n", k3_isa());
    for (int64_t count = read_number(), i = 0; i < count; i++) {
        if (read_number() == 0)
            matrix_case(threads);
        else
            experts_case(threads);
    }
    if (fclose(results) != 0) fail("cannot write the results");
    return 0;
}
