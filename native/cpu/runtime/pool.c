/* A pthreads pool for the kernels: n - 1 workers plus the calling thread.
 *
 * A job is a count of chunks, cut into one contiguous home range per thread (the caller is thread
 * 0, worker i thread i). A thread claims the chunks of its own range in order from that range's
 * atomic counter, then helps the others by claiming from theirs, until none are left: a thread the
 * OS preempts (the machine may be shared) only delays the chunk it holds. Contiguous ranges keep
 * each thread's weight reads one forward stream, so the kernels' prefetch of the rows after a chunk
 * (DD_PREFETCH_ROWS) fetches what the same thread reads next, not rows another core is reading
 * (with one shared counter, threads took every other chunk). Each chunk's result depends only on
 * its index, never on the thread that ran it. dd_pool_for_limit caps the threads that claim chunks:
 * a job with limit L has min(L, workers + 1) home ranges, and only threads 0 .. ranges - 1 claim;
 * the others enter and leave the job without claiming.
 *
 * A job is published by bumping a generation counter. Workers spin on it briefly (decode issues
 * many small products back to back, and a futex wake costs more than a small GEMV), then sleep
 * on a condition variable. `state` counts the workers inside the current job, plus a CLOSED bit
 * that the caller sets once every chunk is claimed; a worker that arrives after that leaves
 * without touching the job, and the caller returns when no worker is inside. Callers from
 * different threads take turns (run_lock). After fork() the child builds new workers on first use.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "runtime.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define dd_cpu_relax() _mm_pause()
#else
#define dd_cpu_relax() ((void)0)
#endif

#define SPIN_ROUNDS 20000          /* ~0.1-0.5 ms of pause instructions before sleeping */
#define CLOSED 0x80000000u

static struct {
    pthread_mutex_t run_lock;      /* one job at a time */
    pthread_mutex_t lock;          /* guards sleeping, waiting_done and the condition variables */
    pthread_cond_t wake, done;
    int nthreads;                  /* requested, >= 1 */
    int nworkers;                  /* running worker threads */
    pthread_t *workers;
    _Atomic unsigned generation;
    _Atomic unsigned state;        /* CLOSED | workers inside the current job */
    unsigned start_generation;     /* what a worker created now has seen */
    _Atomic int stop;
    dd_chunk_fn fn;                /* the current job; read only by threads inside it */
    void *ctx;
    int sleeping, waiting_done;
    int nranges;                   /* home ranges of the current job: min(limit, nworkers + 1) */
} pool = {
    .run_lock = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
    .nthreads = 1,
    .state = CLOSED,
};

/* Thread t's home range of the current job: chunks [next, end), next claimed by atomic increments
 * (by t, or by a thread that finished its own range); one cache line each. */
static struct {
    _Alignas(64) _Atomic size_t next;
    size_t end;
} ranges[DD_MAX_THREADS];

/* Thread `self` runs the chunks of its own range, then of the ranges after it (cyclically). */
static void claim_chunks(int self)
{
    for (int i = 0; i < pool.nranges; i++) {
        const int t = (self + i) % pool.nranges;
        size_t c;
        while ((c = atomic_fetch_add_explicit(&ranges[t].next, 1, memory_order_relaxed)) < ranges[t].end)
            pool.fn(pool.ctx, c);
    }
}

static void *worker_main(void *arg)
{
    const int self = (int)(uintptr_t)arg;
    unsigned seen = pool.start_generation;
    for (;;) {
        unsigned gen = seen;
        for (int i = 0; i < SPIN_ROUNDS && gen == seen && !atomic_load(&pool.stop); i++) {
            dd_cpu_relax();
            gen = atomic_load_explicit(&pool.generation, memory_order_acquire);
        }
        if (gen == seen && !atomic_load(&pool.stop)) {
            pthread_mutex_lock(&pool.lock);
            pool.sleeping++;
            while ((gen = atomic_load(&pool.generation)) == seen && !atomic_load(&pool.stop))
                pthread_cond_wait(&pool.wake, &pool.lock);
            pool.sleeping--;
            pthread_mutex_unlock(&pool.lock);
        }
        if (atomic_load(&pool.stop))
            return NULL;
        seen = gen;
        if (!(atomic_fetch_add_explicit(&pool.state, 1, memory_order_acq_rel) & CLOSED) && self < pool.nranges)
            claim_chunks(self);
        if (atomic_fetch_sub_explicit(&pool.state, 1, memory_order_acq_rel) == (CLOSED | 1u)) {
            pthread_mutex_lock(&pool.lock);
            if (pool.waiting_done)
                pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
}

static void stop_workers(void)
{
    if (pool.nworkers == 0)
        return;
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.stop, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < pool.nworkers; i++)
        pthread_join(pool.workers[i], NULL);
    free(pool.workers);
    pool.workers = NULL;
    pool.nworkers = 0;
    atomic_store(&pool.stop, 0);
}

/* Start the workers for the requested count; if the OS refuses some, run with fewer. */
static void start_workers(void)
{
    const int want = pool.nthreads - 1;
    pool.start_generation = atomic_load(&pool.generation);
    pool.workers = calloc((size_t)want, sizeof(pthread_t));
    if (pool.workers == NULL)
        return;
    while (pool.nworkers < want && pthread_create(&pool.workers[pool.nworkers], NULL, worker_main,
                                                  (void *)(uintptr_t)(pool.nworkers + 1)) == 0)
        pool.nworkers++;
}

static void reset_after_fork(void)
{
    pthread_mutex_init(&pool.run_lock, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = NULL;
    pool.nworkers = 0;
    pool.sleeping = 0;
    pool.waiting_done = 0;
    atomic_store(&pool.state, CLOSED);
    atomic_store(&pool.stop, 0);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, reset_after_fork);
}

void dd_set_threads(int n)
{
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&pool.run_lock);
    if (n < 1)
        n = 1;
    if (n > DD_MAX_THREADS)
        n = DD_MAX_THREADS;
    if (n != pool.nthreads) {
        stop_workers();
        pool.nthreads = n;
    }
    pthread_mutex_unlock(&pool.run_lock);
}

int dd_get_threads(void)
{
    return pool.nthreads;
}

static void run_locked(dd_chunk_fn fn, void *ctx, size_t nchunks, int limit)
{
    if (pool.nworkers == 0 && pool.nthreads > 1)
        start_workers();
    if (pool.nworkers == 0) {
        for (size_t c = 0; c < nchunks; c++)
            fn(ctx, c);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nranges = pool.nworkers + 1 < limit ? pool.nworkers + 1 : limit;
    for (int t = 0; t < pool.nranges; t++) {
        atomic_store_explicit(&ranges[t].next, nchunks * (size_t)t / (size_t)pool.nranges, memory_order_relaxed);
        ranges[t].end = nchunks * (size_t)(t + 1) / (size_t)pool.nranges;
    }
    /* open the job; a worker bouncing off the previous (closed) one may still hold a count */
    unsigned expect = CLOSED;
    while (!atomic_compare_exchange_weak_explicit(&pool.state, &expect, 0, memory_order_release, memory_order_relaxed)) {
        expect = CLOSED;
        dd_cpu_relax();
    }
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    if (pool.sleeping)
        pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    claim_chunks(0);

    if (atomic_fetch_or_explicit(&pool.state, CLOSED, memory_order_acq_rel) == 0)
        return;
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        if (atomic_load_explicit(&pool.state, memory_order_acquire) == CLOSED)
            return;
        dd_cpu_relax();
    }
    pthread_mutex_lock(&pool.lock);
    pool.waiting_done = 1;
    while (atomic_load(&pool.state) != CLOSED)
        pthread_cond_wait(&pool.done, &pool.lock);
    pool.waiting_done = 0;
    pthread_mutex_unlock(&pool.lock);
}

void dd_pool_for_limit(dd_chunk_fn fn, void *ctx, size_t nchunks, int max_threads)
{
    if (nchunks <= 1 || pool.nthreads == 1 || max_threads <= 1) {
        for (size_t c = 0; c < nchunks; c++)
            fn(ctx, c);
        return;
    }
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&pool.run_lock);
    run_locked(fn, ctx, nchunks, max_threads);
    pthread_mutex_unlock(&pool.run_lock);
}

void dd_pool_for(dd_chunk_fn fn, void *ctx, size_t nchunks)
{
    dd_pool_for_limit(fn, ctx, nchunks, DD_MAX_THREADS);
}
