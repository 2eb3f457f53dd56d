/*
 * bench.c - low-overhead benchmark client and host server for benchmarks/run.py.
 *
 * The same protocol as client.py / hostserver.py (which stay as the fallback when no C
 * compiler is present), without the interpreter's per-call cost, so that the figures
 * measure the network path rather than the measuring tools.
 *
 *   bench server ADDR TCP_PORT UDP_PORT
 *       TCP: echo what arrives, close on EOF. UDP: echo every datagram. One epoll loop.
 *       Prints {"ready": true, ...} when bound; on SIGTERM prints {"accepted": N, "open": M}.
 *
 *   bench crr|rr|udprr|ccrr HOST PORT DURATION_S WARMUP_S [PARALLEL]
 *       crr:   connect, send 1 byte, receive 1 byte, close; repeated.
 *       rr:    one connection; send 1 byte, receive 1 byte; repeated.
 *       udprr: one connected UDP socket; send 1 byte, receive 1 byte; a reply missing after
 *              200 ms counts as lost and the request is sent again.
 *       ccrr:  PARALLEL non-blocking CRR state machines multiplexed with epoll.
 *       Prints one JSON line: n, elapsed_s, rate, p50/p90/p99/mean/max (microseconds over the
 *       iterations after WARMUP_S), errors/lost, total (all iterations incl. warm-up).
 *
 * Build: cc -O2 -o bench bench.c   (run.py does this itself; vhost_user.py builds it with -static
 * and puts it into the QEMU guest as /bin/bench).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *what)
{
	fprintf(stderr, "bench: %s: %s\n", what, strerror(errno));
	exit(1);
}

/* ---- samples ---------------------------------------------------------------------- */

struct samples {
	int64_t *v;
	size_t n, cap;
};

static void add_sample(struct samples *s, int64_t x)
{
	if (s->n == s->cap) {
		s->cap = s->cap ? s->cap * 2 : 65536;
		s->v = realloc(s->v, s->cap * sizeof(*s->v));
		if (!s->v)
			die("realloc");
	}
	s->v[s->n++] = x;
}

static int cmp64(const void *a, const void *b)
{
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return (x > y) - (x < y);
}

static void report(const char *mode, struct samples *s, double elapsed, const char *extra_key,
		   long extra, long total, int parallel)
{
	size_t n = s->n;
	printf("{\"mode\": \"%s\", \"impl\": \"c\", \"n\": %zu, \"elapsed_s\": %.4f, \"rate\": %.1f",
	       mode, n, elapsed, elapsed > 0 ? n / elapsed : 0.0);
	if (n) {
		double sum = 0;
		qsort(s->v, n, sizeof(*s->v), cmp64);
		for (size_t i = 0; i < n; i++)
			sum += s->v[i];
#define PCT(p) (s->v[(size_t)((p) / 100.0 * n) < n ? (size_t)((p) / 100.0 * n) : n - 1] / 1000.0)
		printf(", \"p50\": %.2f, \"p90\": %.2f, \"p99\": %.2f, \"mean\": %.2f, \"max\": %.2f",
		       PCT(50), PCT(90), PCT(99), sum / n / 1000.0, s->v[n - 1] / 1000.0);
	}
	printf(", \"%s\": %ld, \"total\": %ld", extra_key, extra, total);
	if (parallel)
		printf(", \"parallel\": %d", parallel);
	printf("}\n");
	fflush(stdout);
}

/* ---- client ----------------------------------------------------------------------- */

static struct sockaddr_in dst;

static void set_timeouts(int fd, int ms)
{
	struct timeval tv = { ms / 1000, (ms % 1000) * 1000 };
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

static void tune_netns(void)
{
	const char *files[][2] = { { "/proc/sys/net/ipv4/tcp_tw_reuse", "1" },
				   { "/proc/sys/net/ipv4/ip_local_port_range", "1024 65535" } };
	for (int i = 0; i < 2; i++) {
		int fd = open(files[i][0], O_WRONLY);
		if (fd >= 0) {
			if (write(fd, files[i][1], strlen(files[i][1])) < 0) {
				/* not fatal */
			}
			close(fd);
		}
	}
}

static void run_crr(double duration, double warmup)
{
	struct samples s = { 0 };
	long errors = 0, total = 0;
	int one = 1;
	char c;
	int64_t start = now_ns(), from = start + (int64_t)(warmup * 1e9), end = from + (int64_t)(duration * 1e9);
	int64_t t_measure = 0;

	for (;;) {
		int64_t t0 = now_ns();
		if (t0 >= end)
			break;
		int fd = socket(AF_INET, SOCK_STREAM, 0);
		if (fd < 0)
			die("socket");
		set_timeouts(fd, 2000);
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		if (connect(fd, (struct sockaddr *)&dst, sizeof(dst)) < 0 || send(fd, "x", 1, 0) != 1 ||
		    recv(fd, &c, 1, 0) != 1) {
			errors++;
			close(fd);
			continue;
		}
		close(fd);
		int64_t t1 = now_ns();
		total++;
		if (t0 >= from) {
			if (!t_measure)
				t_measure = t0;
			add_sample(&s, t1 - t0);
		}
	}
	report("crr", &s, (now_ns() - (t_measure ? t_measure : end)) / 1e9, "errors", errors, total, 0);
}

static void run_rr(double duration, double warmup)
{
	struct samples s = { 0 };
	long total = 0;
	int one = 1;
	char c;
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0)
		die("socket");
	set_timeouts(fd, 2000);
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (connect(fd, (struct sockaddr *)&dst, sizeof(dst)) < 0)
		die("connect");
	int64_t start = now_ns(), from = start + (int64_t)(warmup * 1e9), end = from + (int64_t)(duration * 1e9);
	int64_t t_measure = 0;
	for (;;) {
		int64_t t0 = now_ns();
		if (t0 >= end)
			break;
		if (send(fd, "x", 1, 0) != 1 || recv(fd, &c, 1, 0) != 1)
			die("rr: send/recv");
		int64_t t1 = now_ns();
		total++;
		if (t0 >= from) {
			if (!t_measure)
				t_measure = t0;
			add_sample(&s, t1 - t0);
		}
	}
	close(fd);
	report("rr", &s, (now_ns() - (t_measure ? t_measure : end)) / 1e9, "errors", 0, total, 0);
}

static void run_udprr(double duration, double warmup)
{
	struct samples s = { 0 };
	long lost = 0, total = 0;
	char buf[64];
	int fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0)
		die("socket");
	set_timeouts(fd, 200);
	if (connect(fd, (struct sockaddr *)&dst, sizeof(dst)) < 0)
		die("connect");
	int64_t start = now_ns(), from = start + (int64_t)(warmup * 1e9), end = from + (int64_t)(duration * 1e9);
	int64_t t_measure = 0;
	for (;;) {
		int64_t t0 = now_ns();
		if (t0 >= end)
			break;
		if (send(fd, "x", 1, 0) != 1 || recv(fd, buf, sizeof(buf), 0) < 1) {
			lost++;
			if (errno == ECONNREFUSED)
				usleep(200000);
			continue;
		}
		int64_t t1 = now_ns();
		total++;
		if (t0 >= from) {
			if (!t_measure)
				t_measure = t0;
			add_sample(&s, t1 - t0);
		}
	}
	report("udprr", &s, (now_ns() - (t_measure ? t_measure : end)) / 1e9, "lost", lost, total, 0);
}

struct slot {
	int fd;
	int state; /* 0 connecting, 1 awaiting reply */
	int64_t t0;
};

static void run_ccrr(double duration, double warmup, int parallel)
{
	struct samples s = { 0 };
	long errors = 0, total = 0;
	int one = 1, live = 0;
	int ep = epoll_create1(0);
	struct slot *slots = calloc(parallel, sizeof(*slots));
	int64_t start = now_ns(), from = start + (int64_t)(warmup * 1e9), end = from + (int64_t)(duration * 1e9);
	int64_t t_measure = 0;

	if (ep < 0 || !slots)
		die("epoll/calloc");
#define LAUNCH(i)                                                                                      \
	do {                                                                                           \
		struct slot *sl = &slots[i];                                                           \
		sl->t0 = now_ns();                                                                     \
		sl->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);                              \
		if (sl->fd < 0)                                                                        \
			die("socket");                                                                 \
		setsockopt(sl->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));                       \
		if (connect(sl->fd, (struct sockaddr *)&dst, sizeof(dst)) < 0 && errno != EINPROGRESS) \
			die("connect");                                                                \
		sl->state = 0;                                                                         \
		struct epoll_event ev = { .events = EPOLLOUT, .data.u32 = (uint32_t)(i) };             \
		epoll_ctl(ep, EPOLL_CTL_ADD, sl->fd, &ev);                                             \
		live++;                                                                                \
	} while (0)

	for (int i = 0; i < parallel; i++)
		LAUNCH(i);
	struct epoll_event evs[256];
	while (live) {
		int n = epoll_wait(ep, evs, 256, 100);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			die("epoll_wait");
		}
		if (n == 0) {
			int64_t t = now_ns();
			for (int i = 0; i < parallel; i++) {
				if (slots[i].fd >= 0 && t - slots[i].t0 > 2000000000LL) {
					close(slots[i].fd);
					slots[i].fd = -1;
					live--;
					errors++;
					if (t < end)
						LAUNCH(i);
				}
			}
			continue;
		}
		for (int k = 0; k < n; k++) {
			int i = (int)evs[k].data.u32;
			struct slot *sl = &slots[i];
			int ok = 1;
			char c;
			if (sl->fd < 0)
				continue;
			if (sl->state == 0) {
				int err = 0;
				socklen_t len = sizeof(err);
				getsockopt(sl->fd, SOL_SOCKET, SO_ERROR, &err, &len);
				if (!err && send(sl->fd, "x", 1, 0) == 1) {
					struct epoll_event ev = { .events = EPOLLIN, .data.u32 = (uint32_t)i };
					sl->state = 1;
					epoll_ctl(ep, EPOLL_CTL_MOD, sl->fd, &ev);
					continue;
				}
				ok = 0;
			} else {
				ssize_t r = recv(sl->fd, &c, 1, 0);
				if (r < 0 && (errno == EAGAIN || errno == EINTR))
					continue;
				ok = r == 1;
			}
			close(sl->fd); /* also removes it from the epoll set */
			sl->fd = -1;
			live--;
			total++;
			int64_t t1 = now_ns();
			if (ok) {
				if (sl->t0 >= from && t1 <= end) {
					if (!t_measure)
						t_measure = sl->t0;
					add_sample(&s, t1 - sl->t0);
				}
			} else {
				errors++;
			}
			if (t1 < end)
				LAUNCH(i);
		}
	}
	report("ccrr", &s, (end - (t_measure ? t_measure : end)) / 1e9, "errors", errors, total, parallel);
}

/* ---- server ----------------------------------------------------------------------- */

static volatile sig_atomic_t stopping;

static void on_term(int sig)
{
	(void)sig;
	stopping = 1;
}

static int run_server(const char *addr, int tcp_port, int udp_port)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	struct rlimit rl;
	int one = 1;
	long accepted = 0, open_conns = 0;

	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	if (inet_pton(AF_INET, addr, &a.sin_addr) != 1) {
		fprintf(stderr, "bench: bad address %s\n", addr);
		return 2;
	}
	int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	int ufd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
	if (lfd < 0 || ufd < 0)
		die("socket");
	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	setsockopt(ufd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	a.sin_port = htons(tcp_port);
	if (bind(lfd, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(lfd, 4096) < 0)
		die("bind/listen tcp");
	a.sin_port = htons(udp_port);
	if (bind(ufd, (struct sockaddr *)&a, sizeof(a)) < 0)
		die("bind udp");
	int ep = epoll_create1(0);
	struct epoll_event ev = { .events = EPOLLIN, .data.fd = lfd };
	epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
	ev.data.fd = ufd;
	epoll_ctl(ep, EPOLL_CTL_ADD, ufd, &ev);

	struct sigaction sa = { .sa_handler = on_term };
	sigaction(SIGTERM, &sa, NULL);
	printf("{\"ready\": true, \"impl\": \"c\", \"addr\": \"%s\", \"tcp\": %d, \"udp\": %d}\n", addr, tcp_port,
	       udp_port);
	fflush(stdout);

	struct epoll_event evs[512];
	char buf[65536];
	while (!stopping) {
		int n = epoll_wait(ep, evs, 512, 1000);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			die("epoll_wait");
		}
		for (int k = 0; k < n; k++) {
			int fd = evs[k].data.fd;
			if (fd == lfd) {
				for (;;) {
					int c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
					if (c < 0)
						break;
					setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
					struct epoll_event cev = { .events = EPOLLIN, .data.fd = c };
					epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev);
					accepted++;
					open_conns++;
				}
			} else if (fd == ufd) {
				for (int i = 0; i < 64; i++) {
					struct sockaddr_in peer;
					socklen_t plen = sizeof(peer);
					ssize_t r = recvfrom(ufd, buf, sizeof(buf), 0, (struct sockaddr *)&peer, &plen);
					if (r < 0)
						break;
					sendto(ufd, buf, r, 0, (struct sockaddr *)&peer, plen);
				}
			} else {
				ssize_t r = recv(fd, buf, sizeof(buf), 0);
				if (r > 0) {
					if (send(fd, buf, r, MSG_NOSIGNAL) >= 0)
						continue;
				} else if (r < 0 && (errno == EAGAIN || errno == EINTR)) {
					continue;
				}
				close(fd);
				open_conns--;
			}
		}
	}
	printf("{\"accepted\": %ld, \"open\": %ld}\n", accepted, open_conns);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc >= 5 && !strcmp(argv[1], "server"))
		return run_server(argv[2], atoi(argv[3]), atoi(argv[4]));
	if (argc < 6) {
		fprintf(stderr, "usage: bench server ADDR TCP_PORT UDP_PORT\n"
				"       bench crr|rr|udprr|ccrr HOST PORT DURATION_S WARMUP_S [PARALLEL]\n");
		return 2;
	}
	dst.sin_family = AF_INET;
	dst.sin_port = htons(atoi(argv[3]));
	if (inet_pton(AF_INET, argv[2], &dst.sin_addr) != 1) {
		fprintf(stderr, "bench: bad address %s\n", argv[2]);
		return 2;
	}
	double duration = atof(argv[4]), warmup = atof(argv[5]);
	signal(SIGPIPE, SIG_IGN);
	tune_netns();
	if (!strcmp(argv[1], "crr"))
		run_crr(duration, warmup);
	else if (!strcmp(argv[1], "rr"))
		run_rr(duration, warmup);
	else if (!strcmp(argv[1], "udprr"))
		run_udprr(duration, warmup);
	else if (!strcmp(argv[1], "ccrr"))
		run_ccrr(duration, warmup, argc > 6 ? atoi(argv[6]) : 8);
	else {
		fprintf(stderr, "bench: unknown mode %s\n", argv[1]);
		return 2;
	}
	return 0;
}
