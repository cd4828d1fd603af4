/* A pthreads pool for the kernels: n - 1 workers plus the calling thread.
 *
 * A job is a count of chunks; the caller and the workers claim chunks from an atomic counter
 * until none are left, so a thread the OS preempts (the machine may be shared) only delays the
 * chunk it holds. Each chunk's result depends only on its index, never on the thread that ran it.
 *
 * A job is published by bumping a generation counter. Workers spin on it briefly (decode issues
 * many small products back to back, and a futex wake costs more than a small GEMV), then sleep
 * on a condition variable. `state` counts the workers inside the current job, plus a CLOSED bit
 * that the caller sets once every chunk is claimed; a worker that arrives after that leaves
 * without touching the job, and the caller returns when no worker is inside. Callers from
 * different threads take turns (run_lock). After fork() the child builds new workers on first use.
 * dd_pool_for_limit caps the threads that claim chunks: worker i (0-based) takes part only when
 * i + 1 < the job's limit, the others enter and leave the job without claiming.
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
    _Atomic size_t next_chunk;
    _Atomic int stop;
    dd_chunk_fn fn;                /* the current job; read only by threads inside it */
    void *ctx;
    size_t nchunks;
    int limit;                     /* threads that may claim chunks in the current job, caller included */
    int sleeping, waiting_done;
} pool = {
    .run_lock = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
    .nthreads = 1,
    .state = CLOSED,
};

static void claim_chunks(void)
{
    size_t c;
    while ((c = atomic_fetch_add_explicit(&pool.next_chunk, 1, memory_order_relaxed)) < pool.nchunks)
        pool.fn(pool.ctx, c);
}

/* What a worker starts with: the generation it has seen and its index. */
typedef struct {
    unsigned seen;
    int index;
} worker_arg;

static worker_arg worker_args[DD_MAX_THREADS];

static void *worker_main(void *arg)
{
    unsigned seen = ((const worker_arg *)arg)->seen;
    const int index = ((const worker_arg *)arg)->index;
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
        if (!(atomic_fetch_add_explicit(&pool.state, 1, memory_order_acq_rel) & CLOSED) && index + 1 < pool.limit)
            claim_chunks();
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
    const unsigned gen = atomic_load(&pool.generation);
    pool.workers = calloc((size_t)want, sizeof(pthread_t));
    if (pool.workers == NULL)
        return;
    for (; pool.nworkers < want; pool.nworkers++) {
        worker_args[pool.nworkers] = (worker_arg){ .seen = gen, .index = pool.nworkers };
        if (pthread_create(&pool.workers[pool.nworkers], NULL, worker_main, &worker_args[pool.nworkers]) != 0)
            break;
    }
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
    pool.nchunks = nchunks;
    pool.limit = limit;
    atomic_store_explicit(&pool.next_chunk, 0, memory_order_relaxed);
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

    claim_chunks();

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
