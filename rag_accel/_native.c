/* The hot loops of rag_accel.kernels in C: the same results as the Python there, token for token and float for float
 * (the same operations on doubles, in the same order; built without fast-math).
 *
 * - counted_draft: CountedSuffixes' and the memory's choice (the match levels and the most frequent walk).
 * - longest_match: SuffixArrayIndex's narrowing by binary searches and its earliest continuation.
 * - suffix_order: suffix_array's sort (the reference index's, built once a request).
 * - index_positions: CountedSuffixes.extend's positions of new tokens.
 *
 * Built at install where a C compiler is found (setup.py: optional); rag_accel.kernels runs its Python otherwise.
 * Sources are read as sequences of ints (lists and tuples directly, anything else item by item); the reference
 * index's suffix array and reversed source (longest_match, suffix_order) as int64 arrays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#define SEPARATOR (-1LL)
#define END_MARK (-2LL)

/* ------------------------------------------------------------------ reading ints from sequences */

/* item i of seq as a long long; -1 with an error set on failure (check PyErr_Occurred) */
static inline long long item_at(PyObject *seq, Py_ssize_t i) {
    /* (bounds checked: a position out of its source, or a list changed under a collection's finalizer) */
    int direct = PyList_CheckExact(seq) || PyTuple_CheckExact(seq);
    if (i < 0 || (direct && i >= PySequence_Fast_GET_SIZE(seq))) {
        PyErr_SetString(PyExc_IndexError, "a position outside its token sequence");
        return -1;
    }
    if (direct) return PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    PyObject *o = PySequence_GetItem(seq, i);
    if (o == NULL) return -1;
    long long v = PyLong_AsLongLong(o);
    Py_DECREF(o);
    return v;
}

#define FAILED(v) ((v) == -1 && PyErr_Occurred())

/* ------------------------------------------------------------------ counted_draft */

typedef struct {
    PyObject *src;
    Py_ssize_t len;
} Source;

/* a token -> slot table for one walk level: open addressing, cleared slot by slot */
typedef struct {
    long long *keys;
    Py_ssize_t *value;  /* index into the level's distinct tokens; -1: empty */
    Py_ssize_t mask;
    Py_ssize_t *used;
    Py_ssize_t n_used;
} Table;

static int table_init(Table *t, Py_ssize_t n) {
    Py_ssize_t cap = 16;
    while (cap < 2 * n + 2) cap <<= 1;
    t->keys = PyMem_Malloc(sizeof(long long) * cap);
    t->value = PyMem_Malloc(sizeof(Py_ssize_t) * cap);
    t->used = PyMem_Malloc(sizeof(Py_ssize_t) * cap);
    if (!t->keys || !t->value || !t->used) return -1;
    for (Py_ssize_t i = 0; i < cap; i++) t->value[i] = -1;
    t->mask = cap - 1;
    t->n_used = 0;
    return 0;
}

static void table_free(Table *t) {
    PyMem_Free(t->keys);
    PyMem_Free(t->value);
    PyMem_Free(t->used);
}

static void table_clear(Table *t) {
    for (Py_ssize_t i = 0; i < t->n_used; i++) t->value[t->used[i]] = -1;
    t->n_used = 0;
}

/* the slot of key (inserting it with value `fresh` if absent): returns its value */
static Py_ssize_t table_get_or_add(Table *t, long long key, Py_ssize_t fresh) {
    unsigned long long h = (unsigned long long)key * 0x9E3779B97F4A7C15ULL;
    Py_ssize_t i = (Py_ssize_t)(h >> 32) & t->mask;
    while (t->value[i] != -1) {
        if (t->keys[i] == key) return t->value[i];
        i = (i + 1) & t->mask;
    }
    t->keys[i] = key;
    t->value[i] = fresh;
    t->used[t->n_used++] = i;
    return fresh;
}

/* The most frequent path from the occurrences (g[k] in sources, p[k]), as kernels._walk: out/probs filled (up to
 * cap), their count in *n_out, the score in *score. g and p are overwritten. Returns -1 on an error. */
static int walk(Source *sources, Py_ssize_t *g, Py_ssize_t *p, Py_ssize_t count, long long node, Py_ssize_t cap,
                double min_prob, Table *table, long long *next, long long *distinct, Py_ssize_t *counts,
                long long *out, double *probs, Py_ssize_t *n_out, double *score) {
    double prob = 1.0;
    Py_ssize_t n = 0;
    *score = 0.0;
    while (n < cap && node) {
        Py_ssize_t n_distinct = 0;
        table_clear(table);
        for (Py_ssize_t k = 0; k < count; k++) {
            Source *s = &sources[g[k]];
            Py_ssize_t q = p[k] + 1;
            next[k] = END_MARK;
            if (q < s->len) {
                long long t = item_at(s->src, q);
                if (FAILED(t)) return -1;
                if (t != SEPARATOR) {
                    Py_ssize_t slot = table_get_or_add(table, t, n_distinct);
                    if (slot == n_distinct) {
                        distinct[n_distinct] = t;
                        counts[n_distinct++] = 0;
                    }
                    counts[slot]++;
                    next[k] = t;
                }
            }
        }
        if (n_distinct == 0) break;
        Py_ssize_t top = 0;  /* the first seen on ties */
        for (Py_ssize_t j = 1; j < n_distinct; j++)
            if (counts[j] > counts[top]) top = j;
        long long token = distinct[top];
        Py_ssize_t c = counts[top];
        prob *= (double)c / (double)node;
        if (prob < min_prob) break;
        out[n] = token;
        probs[n] = prob;
        n++;
        *score += prob;
        Py_ssize_t kept = 0;
        for (Py_ssize_t k = 0; k < count; k++) {
            if (next[k] == token) {
                g[kept] = g[k];
                p[kept] = p[k] + 1;
                kept++;
            }
        }
        count = kept;
        node = c;
    }
    *n_out = n;
    return 0;
}

static PyObject *draft_tuple(long long *out, double *probs, Py_ssize_t n, Py_ssize_t m) {
    PyObject *tokens = PyList_New(n), *ps = PyList_New(n);
    if (!tokens || !ps) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyLong_FromLongLong(out[i]), *f = PyFloat_FromDouble(probs[i]);
        if (!t || !f) {
            Py_XDECREF(t);
            Py_XDECREF(f);
            goto fail;
        }
        PyList_SET_ITEM(tokens, i, t);
        PyList_SET_ITEM(ps, i, f);
    }
    return Py_BuildValue("(NNn)", tokens, ps, m);
fail:
    Py_XDECREF(tokens);
    Py_XDECREF(ps);
    return NULL;
}

static PyObject *native_counted_draft(PyObject *self, PyObject *args) {
    PyObject *groups, *pattern;
    Py_ssize_t max_len, max_depth;
    double factor, min_prob;
    int tail;
    if (!PyArg_ParseTuple(args, "OOnddnp", &groups, &pattern, &max_len, &factor, &min_prob, &max_depth, &tail))
        return NULL;
    PyObject *fast_groups = PySequence_Fast(groups, "groups must be a sequence");
    if (!fast_groups) return NULL;
    Py_ssize_t n_groups = PySequence_Fast_GET_SIZE(fast_groups);
    Py_ssize_t last = PySequence_Length(pattern);
    PyObject *result = NULL;
    Source *sources = NULL;
    Py_ssize_t *g = NULL, *p = NULL, *dg = NULL, *dp = NULL, *wg = NULL, *wp = NULL, *counts = NULL;
    long long *next = NULL, *distinct = NULL, *out = NULL, *best_out = NULL;
    double *probs = NULL, *best_probs = NULL;
    Table table = {0};
    int have_table = 0;
    if (last < 0) goto done;
    last -= 1;
    /* the occurrences, flattened: (source, position), in the groups' order */
    Py_ssize_t count = 0, longest = 0;
    sources = PyMem_Malloc(sizeof(Source) * (n_groups ? n_groups : 1));
    if (!sources) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n_groups; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(fast_groups, i);
        if (!(PyTuple_Check(pair) || PyList_Check(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "each group must be a (source, positions) pair");
            goto done;
        }
        sources[i].src = PySequence_Fast_GET_ITEM(pair, 0);
        sources[i].len = PySequence_Length(sources[i].src);
        Py_ssize_t n_occ = PySequence_Length(PySequence_Fast_GET_ITEM(pair, 1));
        if (sources[i].len < 0 || n_occ < 0) goto done;
        count += n_occ;
        if (sources[i].len > longest) longest = sources[i].len;
    }
    Py_ssize_t size = count ? count : 1;
    g = PyMem_Malloc(sizeof(Py_ssize_t) * size);
    p = PyMem_Malloc(sizeof(Py_ssize_t) * size);
    dg = PyMem_Malloc(sizeof(Py_ssize_t) * size);
    dp = PyMem_Malloc(sizeof(Py_ssize_t) * size);
    wg = PyMem_Malloc(sizeof(Py_ssize_t) * size);
    wp = PyMem_Malloc(sizeof(Py_ssize_t) * size);
    counts = PyMem_Malloc(sizeof(Py_ssize_t) * size);
    next = PyMem_Malloc(sizeof(long long) * size);
    distinct = PyMem_Malloc(sizeof(long long) * size);
    Py_ssize_t out_size = max_len < longest ? max_len : longest;  /* (a walk moves on in one source) */
    if (out_size < 1) out_size = 1;
    out = PyMem_Malloc(sizeof(long long) * out_size);
    best_out = PyMem_Malloc(sizeof(long long) * out_size);
    probs = PyMem_Malloc(sizeof(double) * out_size);
    best_probs = PyMem_Malloc(sizeof(double) * out_size);
    if (!g || !p || !dg || !dp || !wg || !wp || !counts || !next || !distinct || !out || !best_out || !probs ||
        !best_probs) {
        PyErr_NoMemory();
        goto done;
    }
    if (table_init(&table, count) < 0) { PyErr_NoMemory(); goto done; }
    have_table = 1;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n_groups; i++) {
        PyObject *occ = PySequence_Fast_GET_ITEM(PySequence_Fast_GET_ITEM(fast_groups, i), 1);
        Py_ssize_t n_occ = PySequence_Length(occ);
        for (Py_ssize_t j = 0; j < n_occ; j++) {
            long long v = item_at(occ, j);
            if (FAILED(v)) goto done;
            g[k] = i;
            p[k++] = (Py_ssize_t)v;
        }
    }
    Py_ssize_t best_n = 0, best_m = 0;
    double best_score = 0.0;
    Py_ssize_t m = 1;
    long long extra = tail ? 1 : 0;
    while (count) {
        Py_ssize_t deeper = 0;
        if (m < max_depth && m <= last) {
            long long want = item_at(pattern, last - m);
            if (FAILED(want)) goto done;
            for (Py_ssize_t j = 0; j < count; j++) {
                if (p[j] >= m) {
                    long long v = item_at(sources[g[j]].src, p[j] - m);
                    if (FAILED(v)) goto done;
                    if (v == want) {
                        dg[deeper] = g[j];
                        dp[deeper++] = p[j];
                    }
                }
            }
        }
        if (deeper < count) {  /* the last level with this set of occurrences: its draft */
            Py_ssize_t cap = (Py_ssize_t)((double)m * factor + 1e-6);
            if (max_len < cap) cap = max_len;
            Py_ssize_t n_out = 0;
            double score = 0.0;
            memcpy(wg, g, sizeof(Py_ssize_t) * count);
            memcpy(wp, p, sizeof(Py_ssize_t) * count);
            if (walk(sources, wg, wp, count, (long long)count + extra, cap, min_prob, &table, next, distinct, counts,
                     out, probs, &n_out, &score) < 0)
                goto done;
            if (n_out && score >= best_score) {
                memcpy(best_out, out, sizeof(long long) * n_out);
                memcpy(best_probs, probs, sizeof(double) * n_out);
                best_n = n_out;
                best_m = m;
                best_score = score;
            }
        }
        Py_ssize_t *swap = g;
        g = dg;
        dg = swap;
        swap = p;
        p = dp;
        dp = swap;
        count = deeper;
        m++;
    }
    result = draft_tuple(best_out, best_probs, best_n, best_m);
done:
    if (result == NULL && !PyErr_Occurred()) result = draft_tuple(NULL, NULL, 0, 0);
    if (have_table) table_free(&table);
    PyMem_Free(sources);
    PyMem_Free(g);
    PyMem_Free(p);
    PyMem_Free(dg);
    PyMem_Free(dp);
    PyMem_Free(wg);
    PyMem_Free(wp);
    PyMem_Free(counts);
    PyMem_Free(next);
    PyMem_Free(distinct);
    PyMem_Free(out);
    PyMem_Free(best_out);
    PyMem_Free(probs);
    PyMem_Free(best_probs);
    Py_DECREF(fast_groups);
    return result;
}

/* ------------------------------------------------------------------ longest_match */

/* a C-contiguous int64 buffer of obj (writable if asked); -1 with TypeError otherwise */
static int int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != 8 || !view->format || strchr("qlL", view->format[strlen(view->format) - 1]) == NULL) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s needs int64 arrays", what);
        return -1;
    }
    return 0;
}

#define BAD_POSITION (END_MARK - 1)

/* symbol depth of the suffix sa[i] of rev (END_MARK past its end; BAD_POSITION: sa[i] is not a position of rev) */
static inline long long suffix_symbol(const long long *sa, const long long *rev, Py_ssize_t n, Py_ssize_t i,
                                      Py_ssize_t depth) {
    long long s = sa[i];
    if (s < 0 || s >= n) return BAD_POSITION;
    return s + depth < n ? rev[s + depth] : END_MARK;
}

static PyObject *native_longest_match(PyObject *self, PyObject *args) {
    PyObject *sa_obj, *rev_obj, *tokens, *context;
    Py_ssize_t min_match, m, scan;
    if (!PyArg_ParseTuple(args, "OOOOnnn", &sa_obj, &rev_obj, &tokens, &context, &min_match, &m, &scan))
        return NULL;
    Py_buffer sa_view, rev_view;
    if (int64_buffer(sa_obj, &sa_view, 0, "longest_match") < 0) return NULL;
    if (int64_buffer(rev_obj, &rev_view, 0, "longest_match") < 0) {
        PyBuffer_Release(&sa_view);
        return NULL;
    }
    PyObject *result = NULL;
    const long long *sa = (const long long *)sa_view.buf, *rev = (const long long *)rev_view.buf;
    Py_ssize_t n = rev_view.len / 8, n_context = PySequence_Length(context);
    if (n_context < 0) goto done;
    if (sa_view.len != rev_view.len) {
        PyErr_SetString(PyExc_ValueError, "longest_match: the suffix array and its source differ in length");
        goto done;
    }
    if (n == 0 || n_context == 0) { result = Py_None; Py_INCREF(result); goto done; }
    /* narrow [lo, hi) by the context read backwards: at depth d the suffixes' symbol d (END_MARK past the end) */
    Py_ssize_t lo = 0, hi = n, depth = 0;
    while (depth < (m > 1 ? m : 1)) {
        long long symbol = item_at(context, n_context - 1 - depth);
        if (FAILED(symbol)) goto done;
        Py_ssize_t l = lo, h = hi;  /* first key >= symbol */
        while (l < h) {
            Py_ssize_t mid = (l + h) / 2;
            long long v = suffix_symbol(sa, rev, n, mid, depth);
            if (v == BAD_POSITION) goto bad;
            if (v < symbol) l = mid + 1; else h = mid;
        }
        Py_ssize_t nlo = l;
        h = hi;  /* first key > symbol */
        while (l < h) {
            Py_ssize_t mid = (l + h) / 2;
            long long v = suffix_symbol(sa, rev, n, mid, depth);
            if (v == BAD_POSITION) goto bad;
            if (symbol < v) h = mid; else l = mid + 1;
        }
        if (nlo == l) break;
        lo = nlo;
        hi = l;
        depth++;
    }
    if (depth == 0 || depth < min_match) { result = Py_None; Py_INCREF(result); goto done; }
    long long best = -1;
    Py_ssize_t stop = hi < lo + scan ? hi : lo + scan;
    for (Py_ssize_t i = lo; i < stop; i++) {
        if (sa[i] < 0 || sa[i] >= n) goto bad;
        long long cont = (long long)n - sa[i];
        if (cont < n) {
            long long t = item_at(tokens, (Py_ssize_t)cont);
            if (FAILED(t)) goto done;
            if (t != SEPARATOR && (best < 0 || cont < best)) best = cont;
        }
    }
    if (best < 0) { result = Py_None; Py_INCREF(result); goto done; }
    result = Py_BuildValue("(nL)", depth, best);
    goto done;
bad:
    PyErr_SetString(PyExc_IndexError, "a position outside its token sequence");
done:
    PyBuffer_Release(&sa_view);
    PyBuffer_Release(&rev_view);
    return result;
}

/* ------------------------------------------------------------------ suffix_order */

typedef struct {
    const long long *symbols;
    Py_ssize_t n, depth;
} SuffixOrder;

/* suffix a before suffix b: by their first depth symbols ("past the end" before every symbol), equal ones latest
 * first */
static inline int suffix_before(const SuffixOrder *o, Py_ssize_t a, Py_ssize_t b) {
    const long long *s = o->symbols;
    Py_ssize_t n = o->n;
    for (Py_ssize_t k = 0; k < o->depth; k++) {
        Py_ssize_t i = a + k, j = b + k;
        if (i >= n || j >= n) {
            if (i >= n && j >= n) break;
            return i >= n;
        }
        if (s[i] != s[j]) return s[i] < s[j];
    }
    return a > b;
}

/* order[0:n] sorted by suffix_before: runs of 16 by insertion, then merged bottom-up (tmp: n more) */
static void sort_suffixes(const SuffixOrder *o, Py_ssize_t *order, Py_ssize_t *tmp, Py_ssize_t n) {
    for (Py_ssize_t start = 0; start < n; start += 16) {
        Py_ssize_t stop = start + 16 < n ? start + 16 : n;
        for (Py_ssize_t i = start + 1; i < stop; i++) {
            Py_ssize_t v = order[i], j = i;
            while (j > start && suffix_before(o, v, order[j - 1])) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = v;
        }
    }
    Py_ssize_t *from = order, *to = tmp;
    for (Py_ssize_t width = 16; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) to[k++] = suffix_before(o, from[j], from[i]) ? from[j++] : from[i++];
            while (i < mid) to[k++] = from[i++];
            while (j < hi) to[k++] = from[j++];
        }
        Py_ssize_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != order) memcpy(order, from, sizeof(Py_ssize_t) * (size_t)n);
}

static PyObject *native_suffix_order(PyObject *self, PyObject *args) {
    PyObject *tokens_obj, *out_obj;
    Py_ssize_t depth;
    if (!PyArg_ParseTuple(args, "OnO", &tokens_obj, &depth, &out_obj)) return NULL;
    Py_buffer tokens, out;
    if (int64_buffer(tokens_obj, &tokens, 0, "suffix_order") < 0) return NULL;
    if (int64_buffer(out_obj, &out, 1, "suffix_order") < 0) {
        PyBuffer_Release(&tokens);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = tokens.len / 8;
    if (out.len != tokens.len) {
        PyErr_SetString(PyExc_TypeError, "suffix_order needs two int64 arrays of the same length");
        goto done;
    }
    Py_ssize_t *order = PyMem_Malloc(sizeof(Py_ssize_t) * (2 * n + 1));
    if (order == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) order[i] = i;
    SuffixOrder o = {(const long long *)tokens.buf, n, depth < 0 ? n : depth};
    sort_suffixes(&o, order, order + n, n);
    long long *dest = (long long *)out.buf;
    for (Py_ssize_t i = 0; i < n; i++) dest[i] = order[i];
    PyMem_Free(order);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&out);
    return result;
}

/* ------------------------------------------------------------------ index_positions */

static PyObject *native_index_positions(PyObject *self, PyObject *args) {
    PyObject *pos, *tokens;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!On", &PyDict_Type, &pos, &tokens, &start)) return NULL;
    Py_ssize_t n = PySequence_Length(tokens);
    if (n < 0) return NULL;
    int is_list = PyList_CheckExact(tokens);
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject *t;
        if (is_list) {  /* (its size checked again: a collection an allocation triggers may run Python code) */
            if (i >= PyList_GET_SIZE(tokens)) break;
            t = PyList_GET_ITEM(tokens, i);
            Py_INCREF(t);
        } else if ((t = PySequence_GetItem(tokens, i)) == NULL) {
            return NULL;
        }
        long long v = PyLong_AsLongLong(t);
        if (FAILED(v)) { Py_DECREF(t); return NULL; }
        if (v != SEPARATOR) {
            PyObject *at = PyDict_GetItemWithError(pos, t);  /* borrowed */
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || (at == NULL && PyErr_Occurred())) { Py_XDECREF(index); Py_DECREF(t); return NULL; }
            int failed;
            if (at == NULL) {
                PyObject *list = PyList_New(1);
                if (list == NULL) { Py_DECREF(index); Py_DECREF(t); return NULL; }
                PyList_SET_ITEM(list, 0, index);  /* (steals index) */
                failed = PyDict_SetItem(pos, t, list);
                Py_DECREF(list);
            } else {
                failed = PyList_Append(at, index);
                Py_DECREF(index);
            }
            if (failed) { Py_DECREF(t); return NULL; }
        }
        Py_DECREF(t);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"counted_draft", native_counted_draft, METH_VARARGS,
     "counted_draft(groups, pattern, max_len, factor, min_prob, max_depth, tail): kernels.counted_draft in C."},
    {"longest_match", native_longest_match, METH_VARARGS,
     "longest_match(sa, rev, tokens, context, min_match, m, scan): SuffixArrayIndex.longest_match in C "
     "(sa, rev: int64 arrays)."},
    {"suffix_order", native_suffix_order, METH_VARARGS,
     "suffix_order(tokens, depth, out): suffix_array's order into out (int64 arrays; depth < 0: whole suffixes)."},
    {"index_positions", native_index_positions, METH_VARARGS,
     "index_positions(pos, tokens, start): CountedSuffixes.extend's loop in C."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "rag_accel.kernels' hot loops in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
