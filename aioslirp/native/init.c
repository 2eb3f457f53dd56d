/* aioslirp-init: the native init of aioslirp.spawn()'s PID namespace (internal).
 *
 * The namespace helper (python -m aioslirp.host.nschild, "run" mode with a PID namespace) does the
 * short set-up (namespaces, TAP, resolv.conf, the TAP fd sent back, "go"), then execs this program
 * as
 *
 *     aioslirp-init SOCK_FD
 *
 * with the unshare(CLONE_NEWPID) already made: its first child is PID 1 of the new namespace. So
 * no interpreter stays alive per guest; two small processes do:
 *
 *   the parent (this process, the service's child): reads the command spec from SOCK_FD, forks
 *   PID 1, passes SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT, SIGWINCH, SIGALRM
 *   on to it, and ends as the command ended: its exit status, or death by the same signal;
 *
 *   PID 1 (the fork): PR_SET_PDEATHSIG (SIGKILL when the parent dies, and with PID 1 the whole
 *   namespace), mounts its /proc (best effort), forks and executes the command, passes the same
 *   signals on to it, reaps every orphan, and when the command ends sends its wait status to the
 *   parent and exits, which kills whatever else is left in the namespace.
 *
 * The command spec (argv, env, cwd) never is on a command line or in an environment: the service
 * sends it on SOCK_FD (an AF_UNIX SOCK_SEQPACKET socket) after "go", as records: first
 * "AIOC" + the payload's length (4 bytes, native order), then the payload in records of any size.
 * The payload is NUL-terminated strings: ARGC, ENVC (-1: keep this process's environment),
 * HAS_CWD (0 or 1), then ARGC arguments, ENVC "NAME=value" entries, and the directory when
 * HAS_CWD. The socket stays open in the command until its exec (close-on-exec), so that the
 * service sees EOF once the command runs; when it cannot be executed, the command's process sends
 * {"exec_error": ERRNO, "cwd": true|false} first (false: the command itself) and exits 127
 * (ENOENT on the command) or 126. The command is looked up in the PATH of its own environment
 * (default "/bin:/usr/bin"), as Python's os.execvpe does, with no /bin/sh retry on ENOEXEC.
 *
 * Standard C and Linux system calls only; no third-party code. Built by setup.py (optional: when
 * it is absent aioslirp keeps a Python PID 1, aioslirp.host.nschild).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <poll.h>

#define SPEC_MAX (256u << 20) /* bytes: a sanity bound, far above what execve takes */

extern char **environ;

static const int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT, SIGWINCH, SIGALRM};
#define NFORWARDED (sizeof(forwarded) / sizeof(forwarded[0]))

struct spec {
    char *buf;
    size_t len;
    char **argv;
    char **envp; /* NULL: keep ours */
    char *cwd;   /* NULL: stay */
};

static void die(const char *what) {
    fprintf(stderr, "aioslirp-init: %s: %s\n", what, strerror(errno));
    _exit(1);
}

static int recv_record(int fd, void *buf, size_t len) {
    for (;;) {
        ssize_t n = recv(fd, buf, len, 0);
        if (n >= 0 || errno != EINTR)
            return (int)n;
    }
}

/* The next NUL-terminated string of the payload at *pos, or NULL past its end. */
static char *next_string(struct spec *s, size_t *pos) {
    if (*pos >= s->len)
        return NULL;
    char *str = s->buf + *pos;
    char *end = memchr(str, '\0', s->len - *pos);
    if (end == NULL)
        return NULL;
    *pos = (size_t)(end - s->buf) + 1;
    return str;
}

static int parse_count(const char *str, long min, long *out) {
    char *end;
    if (str == NULL || *str == '\0')
        return -1;
    errno = 0;
    long v = strtol(str, &end, 10);
    if (errno || *end != '\0' || v < min || v > (1L << 24))
        return -1;
    *out = v;
    return 0;
}

/* Read the command spec from the socket (see the top of the file); exits 1 when the service went
 * away or sent something else. */
static void read_spec(int sock, struct spec *s) {
    unsigned char head[8];
    uint32_t len;
    if (recv_record(sock, head, sizeof head) != (int)sizeof head || memcmp(head, "AIOC", 4) != 0)
        _exit(1); /* no spec: the service aborted */
    memcpy(&len, head + 4, 4);
    if (len == 0 || len > SPEC_MAX)
        _exit(1);
    s->buf = malloc(len + 1);
    if (s->buf == NULL)
        die("malloc");
    s->len = 0;
    while (s->len < len) {
        int n = recv_record(sock, s->buf + s->len, len - s->len);
        if (n <= 0)
            _exit(1);
        s->len += (size_t)n;
    }
    s->buf[s->len] = '\0';
    size_t pos = 0;
    long argc, envc, has_cwd;
    if (parse_count(next_string(s, &pos), 1, &argc) || parse_count(next_string(s, &pos), -1, &envc) ||
        parse_count(next_string(s, &pos), 0, &has_cwd) || has_cwd > 1)
        _exit(1);
    s->argv = calloc((size_t)argc + 1, sizeof(char *));
    s->envp = envc < 0 ? NULL : calloc((size_t)envc + 1, sizeof(char *));
    if (s->argv == NULL || (envc >= 0 && s->envp == NULL))
        die("calloc");
    for (long i = 0; i < argc; i++)
        if ((s->argv[i] = next_string(s, &pos)) == NULL)
            _exit(1);
    for (long i = 0; i < envc; i++)
        if ((s->envp[i] = next_string(s, &pos)) == NULL)
            _exit(1);
    s->cwd = has_cwd ? next_string(s, &pos) : NULL;
    if (has_cwd && s->cwd == NULL)
        _exit(1);
}

/* Forget the spec in this process (it holds the caller's argv and env; the command has its own copy). */
static void wipe_spec(struct spec *s) {
    if (s->buf != NULL)
        explicit_bzero(s->buf, s->len);
}

static void send_exec_error(int sock, int err, int in_cwd) {
    char msg[64];
    int n = snprintf(msg, sizeof msg, "{\"exec_error\": %d, \"cwd\": %s}", err, in_cwd ? "true" : "false");
    while (send(sock, msg, (size_t)n, MSG_NOSIGNAL) < 0 && errno == EINTR)
        ;
}

/* The PATH of envp (NULL: ours), as Python's os.get_exec_path(). */
static const char *exec_path(char **envp) {
    char **e = envp != NULL ? envp : environ;
    for (; e != NULL && *e != NULL; e++)
        if (strncmp(*e, "PATH=", 5) == 0)
            return *e + 5;
    return "/bin:/usr/bin";
}

/* execve the command as Python's os.execvpe: a name with a '/' as is, else each PATH entry in
 * turn; the first error other than ENOENT/ENOTDIR wins, else the last. Returns that errno. */
static int exec_command(char **argv, char **envp) {
    char **env = envp != NULL ? envp : environ;
    const char *file = argv[0];
    if (*file == '\0')
        return ENOENT;
    if (strchr(file, '/') != NULL) {
        execve(file, argv, env);
        return errno;
    }
    const char *path = exec_path(envp);
    size_t flen = strlen(file);
    int saved = 0, last = ENOENT;
    for (const char *p = path;; p++) {
        const char *end = strchrnul(p, ':');
        size_t dlen = (size_t)(end - p);
        char *full = malloc(dlen + flen + 2);
        if (full == NULL)
            return ENOMEM;
        memcpy(full, p, dlen);
        size_t at = dlen;
        if (dlen > 0 && p[dlen - 1] != '/')
            full[at++] = '/';
        memcpy(full + at, file, flen + 1);
        execve(full, argv, env);
        last = errno;
        if (last != ENOENT && last != ENOTDIR && saved == 0)
            saved = last;
        free(full);
        if (*end == '\0')
            break;
        p = end;
    }
    return saved != 0 ? saved : last;
}

/* The command's process: default signal dispositions and the mask we started with, chdir, exec. */
static void run_command(int sock, struct spec *s, const sigset_t *oldmask) {
    int ignored[] = {SIGPIPE, SIGXFSZ, SIGCHLD};
    for (size_t i = 0; i < NFORWARDED; i++)
        signal(forwarded[i], SIG_DFL);
    for (size_t i = 0; i < sizeof ignored / sizeof ignored[0]; i++)
        signal(ignored[i], SIG_DFL);
    sigprocmask(SIG_SETMASK, oldmask, NULL);
    fcntl(sock, F_SETFD, FD_CLOEXEC);
    if (s->cwd != NULL && chdir(s->cwd) != 0) {
        int err = errno;
        send_exec_error(sock, err, 1);
        _exit(126);
    }
    int err = exec_command(s->argv, s->envp);
    send_exec_error(sock, err, 0);
    _exit(err == ENOENT ? 127 : 126);
}

/* Wait in sigwaitinfo for the signals of `set`: pass the forwarded ones on to `target`; on SIGCHLD
 * reap every child (orphans too, in PID 1) until `target` has ended. Returns its wait status. */
static int supervise(pid_t target, const sigset_t *set) {
    for (;;) {
        siginfo_t info;
        int sig = sigwaitinfo(set, &info);
        if (sig < 0) {
            if (errno == EINTR)
                continue;
            die("sigwaitinfo");
        }
        if (sig != SIGCHLD) {
            kill(target, sig);
            continue;
        }
        for (;;) {
            int status;
            pid_t pid = waitpid(-1, &status, WNOHANG);
            if (pid == target)
                return status;
            if (pid <= 0)
                break; /* none left to reap now (ECHILD cannot be: target is not reaped yet) */
        }
    }
}

/* PID 1 of the new PID namespace. */
static void pid1(int sock, struct spec *s, int status_fd, int alive_fd, const sigset_t *set,
                 const sigset_t *oldmask) {
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        die("prctl(PR_SET_PDEATHSIG)");
    struct pollfd pfd = {.fd = alive_fd, .events = POLLIN};
    if (poll(&pfd, 1, 0) > 0) /* the parent died before the prctl: the write end is closed */
        _exit(1);
    close(alive_fd);
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL); /* best effort */
    pid_t cmd = fork();
    if (cmd < 0) {
        send_exec_error(sock, errno, 0);
        _exit(126);
    }
    if (cmd == 0) {
        close(status_fd);
        run_command(sock, s, oldmask);
    }
    close(sock);
    wipe_spec(s);
    int status = supervise(cmd, set);
    while (write(status_fd, &status, sizeof status) < 0 && errno == EINTR)
        ;
    _exit(0); /* PID 1 gone: the kernel kills everything left in the namespace */
}

/* End as a process whose wait status is `status` ended: exit with its code, or die of its signal
 * (without a core file of our own). */
static void end_like(int status) {
    if (WIFEXITED(status))
        _exit(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) {
        int sig = WTERMSIG(status);
        struct rlimit none = {0, 0};
        setrlimit(RLIMIT_CORE, &none);
        signal(sig, SIG_DFL);
        sigset_t one;
        sigemptyset(&one);
        sigaddset(&one, sig);
        sigprocmask(SIG_UNBLOCK, &one, NULL);
        raise(sig);
        _exit(128 + sig);
    }
    _exit(1);
}

int main(int argc, char **argv) {
    char *end;
    long sock = argc == 2 ? strtol(argv[1], &end, 10) : -1;
    if (argc != 2 || *argv[1] == '\0' || *end != '\0' || sock < 0 || fcntl((int)sock, F_GETFD) < 0) {
        fprintf(stderr, "aioslirp-init is internal to aioslirp (started by aioslirp.spawn)\n");
        return 2;
    }
    /* Every signal we act on is blocked from the start (none is lost before the fork) and taken
     * with sigwaitinfo: a blocked signal is queued even for PID 1 of a namespace. */
    sigset_t set, oldmask;
    sigemptyset(&set);
    for (size_t i = 0; i < NFORWARDED; i++)
        sigaddset(&set, forwarded[i]);
    sigaddset(&set, SIGCHLD);
    signal(SIGCHLD, SIG_DFL); /* not SIG_IGN: children must stay to be waited for */
    sigprocmask(SIG_BLOCK, &set, &oldmask);

    struct spec s = {0};
    read_spec((int)sock, &s);

    int status_pipe[2], alive_pipe[2];
    if (pipe2(status_pipe, O_CLOEXEC) != 0 || pipe2(alive_pipe, O_CLOEXEC) != 0)
        die("pipe");
    pid_t child = fork();
    if (child < 0) {
        send_exec_error((int)sock, errno, 0);
        return 126;
    }
    if (child == 0) {
        close(status_pipe[0]);
        close(alive_pipe[1]);
        pid1((int)sock, &s, status_pipe[1], alive_pipe[0], &set, &oldmask);
    }
    close(status_pipe[1]);
    close(alive_pipe[0]); /* alive_pipe[1] stays open while we live */
    close((int)sock);
    wipe_spec(&s);
    int status = supervise(child, &set);
    int reported;
    ssize_t n;
    while ((n = read(status_pipe[0], &reported, sizeof reported)) < 0 && errno == EINTR)
        ;
    end_like(n == (ssize_t)sizeof reported ? reported : status);
    return 1;
}
