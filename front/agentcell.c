/* agentcell's compiled front: the `agentcell` command.
 *
 * `agentcell run` is called once per agent tool call, and a Python start alone costs about twice a
 * bubblewrap start; `agentcell session start` spends about half a second importing LangGraph before
 * its first step. When its owner's warm launcher runs (`agentcell warm start`), this program hands
 * the whole command line to it: argv, environment, umask, working directory and stdio (SCM_RIGHTS);
 * the launcher forks a process that becomes this CLI and runs the same Python code (see
 * src/agentcell/host/clihost.py for the protocol and what is checked there, and host/starter.py for
 * a session's). This program forwards its signals to that process and exits with its status.
 *
 * Everything else runs the Python CLI (execv, this process replaced): every other command, either
 * with a terminal on stdin, stdout or stderr (the pty relay and job control live in the CLI), a run
 * with --no-warm, AGENTCELL_FRONT=off or AGENTCELL_WARM=off, no launcher, a launcher that is not ours
 * or that refuses the request. Up to the launcher's "started" nothing has run, so falling back loses
 * nothing; after it, this program never runs the command a second time.
 *
 * What it decides alone, and what a reviewer should check: where the launcher listens (as
 * hostfs.socket_dir() says), that the directory is ours and private, and that the peer is ourselves
 * in all but its pid, as host/peer.py checks both ways: our uid, namespaces, cgroup and audit session,
 * and all our groups, capabilities and hard limits, without a no_new_privs or seccomp filter we lack
 * (a rootless cell, or a weaker process of ours that took the socket's place, must never receive our
 * environment or stdio). It parses no policy and no option of `run`.
 *
 * Built by scripts/setup.sh: cc -O2 -DAGENTCELL_PYTHON=... -DAGENTCELL_SCRIPT=... (the interpreter and
 * bin/agentcell that the fallback runs).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef AGENTCELL_PYTHON
#error "build with -DAGENTCELL_PYTHON=\"/path/to/python3\" (scripts/setup.sh does)"
#endif
#ifndef AGENTCELL_SCRIPT
#error "build with -DAGENTCELL_SCRIPT=\"/path/to/bin/agentcell\" (scripts/setup.sh does)"
#endif

extern char **environ;

static const int FORWARDED[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
#define NFORWARDED (sizeof FORWARDED / sizeof FORWARDED[0])
#define MAX_MESSAGE (1 << 20) /* as host/wire.py: a bigger request runs the Python CLI */
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

/* ---- the Python CLI, in this process's place ------------------------------------------------- */

static sigset_t original_mask;

static void __attribute__((noreturn)) fallback(int argc, char **argv) {
    char **args = calloc((size_t)argc + 2, sizeof *args);
    if (args == NULL) {
        perror("agentcell");
        exit(125);
    }
    args[0] = AGENTCELL_PYTHON;
    args[1] = AGENTCELL_SCRIPT;
    for (int i = 1; i < argc; i++)
        args[i + 1] = argv[i];
    sigprocmask(SIG_SETMASK, &original_mask, NULL);
    execv(AGENTCELL_PYTHON, args);
    fprintf(stderr, "agentcell: cannot run %s: %s (run scripts/setup.sh again)\n", AGENTCELL_PYTHON,
            strerror(errno));
    exit(125);
}

/* Only `agentcell run` without --no-warm (options end at "--") and `agentcell session start`, each
 * without a terminal. */
static int handed_over(int argc, char **argv) {
    int session = argc >= 3 && strcmp(argv[1], "session") == 0 && strcmp(argv[2], "start") == 0;
    if (!session && (argc < 2 || strcmp(argv[1], "run") != 0))
        return 0;
    for (int i = 2; !session && i < argc && strcmp(argv[i], "--") != 0; i++)
        if (strcmp(argv[i], "--no-warm") == 0)
            return 0;
    for (int fd = 0; fd <= 2; fd++)
        if (fcntl(fd, F_GETFD) < 0 || isatty(fd))
            return 0;
    const char *front = getenv("AGENTCELL_FRONT"), *warm = getenv("AGENTCELL_WARM");
    return !(front && strcmp(front, "off") == 0) && !(warm && strcmp(warm, "off") == 0);
}

/* ---- finding our launcher ---------------------------------------------------------------------- */

/* hostfs.socket_dir(): /run/agentcell for root; else $XDG_RUNTIME_DIR/agentcell, $XDG_STATE_HOME/agentcell
 * or ~/.local/state/agentcell (absolute values only). */
static int socket_path(char *out, size_t size) {
    const char *base, *tail = "/agentcell/launcher.sock";
    if (geteuid() == 0)
        return snprintf(out, size, "/run/agentcell/launcher.sock") < (int)size ? 0 : -1;
    if ((base = getenv("XDG_RUNTIME_DIR")) && base[0] == '/')
        return snprintf(out, size, "%s%s", base, tail) < (int)size ? 0 : -1;
    if ((base = getenv("XDG_STATE_HOME")) && base[0] == '/')
        return snprintf(out, size, "%s%s", base, tail) < (int)size ? 0 : -1;
    if ((base = getenv("HOME")) && base[0] == '/')
        return snprintf(out, size, "%s/.local/state%s", base, tail) < (int)size ? 0 : -1;
    return -1; /* (Python would ask the password database: let it) */
}

/* The socket's directory is a real directory of ours that nobody else may enter (remote._private_dir). */
static int private_parent(const char *path) {
    char dir[PATH_MAX];
    struct stat st;
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == NULL || slash == dir)
        return 0;
    *slash = '\0';
    return lstat(dir, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() && (st.st_mode & 077) == 0;
}

/* ---- the launcher is ourselves in all but its pid (src/agentcell/host/peer.py) ------------------------- */

static ssize_t read_file(const char *path, char *buf, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = 0;
    ssize_t n;
    while (len < size - 1 && (n = read(fd, buf + len, size - 1 - len)) > 0)
        len += (size_t)n;
    close(fd);
    buf[len] = '\0';
    return n < 0 ? -1 : (ssize_t)len;
}

static int same_namespace(pid_t pid, const char *ns) {
    char theirs_path[64], ours_path[64];
    struct stat theirs, ours;
    snprintf(theirs_path, sizeof theirs_path, "/proc/%d/ns/%s", (int)pid, ns);
    snprintf(ours_path, sizeof ours_path, "/proc/self/ns/%s", ns);
    if (stat(ours_path, &ours) < 0)
        return errno == ENOENT; /* (a kernel without it) */
    return stat(theirs_path, &theirs) == 0 && theirs.st_dev == ours.st_dev && theirs.st_ino == ours.st_ino;
}

static int same_file(pid_t pid, const char *name) { /* cgroup, loginuid, sessionid */
    char path[64], theirs[4096], ours[4096];
    snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, name);
    ssize_t a = read_file(path, theirs, sizeof theirs);
    snprintf(path, sizeof path, "/proc/self/%s", name);
    ssize_t b = read_file(path, ours, sizeof ours);
    if (a < 0 || b < 0)
        return a < 0 && b < 0 && errno == ENOENT; /* (no audit: no loginuid) */
    return a == b && (size_t)a < sizeof ours - 1 && memcmp(theirs, ours, (size_t)a) == 0;
}

/* The value of "Key:" in a /proc/PID/status text, up to its end of line ("" if absent). */
static const char *field(const char *status, const char *key, size_t *len) {
    size_t k = strlen(key);
    for (const char *line = status; *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : "") {
        if (strncmp(line, key, k) == 0 && line[k] == ':') {
            const char *v = line + k + 1;
            while (*v == '\t' || *v == ' ')
                v++;
            *len = strcspn(v, "\n");
            return v;
        }
    }
    *len = 0;
    return "";
}

static int same_field(const char *theirs, const char *ours, const char *key) {
    size_t a, b;
    const char *x = field(theirs, key, &a), *y = field(ours, key, &b);
    return a == b && memcmp(x, y, a) == 0;
}

static unsigned long long number(const char *status, const char *key, int base) {
    size_t len;
    return strtoull(field(status, key, &len), NULL, base);
}

/* Every supplementary group of ours is one of theirs. */
static int has_our_groups(const char *theirs, const char *ours) {
    size_t tl, ol;
    const char *t = field(theirs, "Groups", &tl), *o = field(ours, "Groups", &ol), *end = o + ol;
    while (o < end) {
        char *next;
        unsigned long g = strtoul(o, &next, 10);
        if (next == o)
            break;
        int found = 0;
        for (const char *p = t, *tend = t + tl; p < tend && !found;) {
            char *pn;
            unsigned long h = strtoul(p, &pn, 10);
            if (pn == p)
                break;
            found = h == g;
            p = pn;
        }
        if (!found)
            return 0;
        o = next;
    }
    return 1;
}

/* Each hard limit of theirs at least ours (/proc/PID/limits: a header, then one line per limit, the
 * hard limit in columns 47-67). */
static int limits_as_high(pid_t pid) {
    char path[64], theirs[4096], ours[4096];
    snprintf(path, sizeof path, "/proc/%d/limits", (int)pid);
    if (read_file(path, theirs, sizeof theirs) < 0 || read_file("/proc/self/limits", ours, sizeof ours) < 0)
        return 0;
    const char *t = strchr(theirs, '\n'), *o = strchr(ours, '\n');
    while (t && o && t[1] && o[1]) {
        t++, o++;
        if (strlen(t) < 68 || strlen(o) < 68 || strncmp(t, o, 26) != 0)
            return 0;
        unsigned long long th = strncmp(t + 47, "unlimited", 9) == 0 ? ~0ULL : strtoull(t + 47, NULL, 10);
        unsigned long long oh = strncmp(o + 47, "unlimited", 9) == 0 ? ~0ULL : strtoull(o + 47, NULL, 10);
        if (th < oh)
            return 0;
        t = strchr(t, '\n'), o = strchr(o, '\n');
    }
    return 1;
}

static int may_do_all_we_may(pid_t pid) {
    static const char *const caps[] = {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"};
    char path[64], theirs[8192], ours[8192];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    if (read_file(path, theirs, sizeof theirs) < 0 || read_file("/proc/self/status", ours, sizeof ours) < 0)
        return 0;
    if (!same_field(theirs, ours, "Uid") || !same_field(theirs, ours, "Gid") || !has_our_groups(theirs, ours))
        return 0;
    for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++)
        if (number(ours, caps[i], 16) & ~number(theirs, caps[i], 16))
            return 0;
    if (number(theirs, "NoNewPrivs", 10) > number(ours, "NoNewPrivs", 10))
        return 0;
    if (number(theirs, "Seccomp", 10) != 0 &&
        !(same_field(theirs, ours, "Seccomp") && same_field(theirs, ours, "Seccomp_filters")))
        return 0;
    return limits_as_high(pid);
}

static pid_t pid_of(int pidfd) {
    char path[64], info[1024];
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", pidfd);
    if (read_file(path, info, sizeof info) < 0)
        return -1;
    size_t len;
    const char *v = field(info, "Pid", &len);
    return len ? (pid_t)strtol(v, NULL, 10) : -1;
}

static int is_ourselves(int s, pid_t cred_pid) {
    static const char *const namespaces[] = {"user", "pid", "mnt", "net", "uts", "ipc", "cgroup", "time"};
    int pidfd;
    socklen_t len = sizeof pidfd;
    if (getsockopt(s, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) < 0)
        pidfd = (int)syscall(SYS_pidfd_open, cred_pid, 0);
    if (pidfd < 0)
        return 0;
    pid_t pid = pid_of(pidfd);
    int ok = pid > 0;
    for (size_t i = 0; ok && i < sizeof namespaces / sizeof namespaces[0]; i++)
        ok = same_namespace(pid, namespaces[i]);
    ok = ok && same_file(pid, "cgroup") && same_file(pid, "loginuid") && same_file(pid, "sessionid") &&
         may_do_all_we_may(pid);
    ok = ok && syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) == 0; /* still that process */
    close(pidfd);
    return ok;
}

/* A connection to our own launcher, or -1 (none, or not ourselves). */
static int connect_launcher(void) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (socket_path(addr.sun_path, sizeof addr.sun_path) < 0 || !private_parent(addr.sun_path))
        return -1;
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -1;
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0 ||
        getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0 || cred.uid != geteuid() ||
        !is_ourselves(s, cred.pid)) {
        close(s);
        return -1;
    }
    return s;
}

/* ---- the wire: one marshal-encoded dict per datagram (host/wire.py) ------------------------------ */

struct buf {
    unsigned char *data;
    size_t len, cap;
    int full;
};

static void put(struct buf *b, const void *p, size_t n) {
    if (b->full || b->len + n > b->cap) {
        b->full = 1;
        return;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

static void put_i32(struct buf *b, unsigned char type, uint32_t v) {
    unsigned char w[5] = {type, (unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 24)};
    put(b, w, sizeof w);
}

static void put_text(struct buf *b, const char *s) { /* a str key (ASCII) */
    put_i32(b, 'u', (uint32_t)strlen(s));
    put(b, s, strlen(s));
}

static void put_bytes(struct buf *b, const char *s) { /* bytes: the CLI decodes them as Python does argv */
    put_i32(b, 's', (uint32_t)strlen(s));
    put(b, s, strlen(s));
}

static void put_list(struct buf *b, char **items, size_t n) {
    put_i32(b, '[', (uint32_t)n);
    for (size_t i = 0; i < n; i++)
        put_bytes(b, items[i]);
}

/* One value of a reply: a str or an int (marshal's refs resolved; anything else is refused). */
struct value {
    int is_int;
    long num;
    const unsigned char *str;
    size_t len;
};

struct reader {
    const unsigned char *p, *end;
    struct value refs[32];
    int nrefs;
};

static int get_u32(struct reader *r, uint32_t *v) {
    if (r->end - r->p < 4)
        return -1;
    *v = (uint32_t)r->p[0] | (uint32_t)r->p[1] << 8 | (uint32_t)r->p[2] << 16 | (uint32_t)r->p[3] << 24;
    r->p += 4;
    return 0;
}

static int get_value(struct reader *r, struct value *v) {
    uint32_t n;
    if (r->p >= r->end)
        return -1;
    int type = *r->p & 0x7f, ref = *r->p & 0x80;
    r->p++;
    memset(v, 0, sizeof *v);
    switch (type) {
    case 'r':
        if (get_u32(r, &n) < 0 || n >= (uint32_t)r->nrefs)
            return -1;
        *v = r->refs[n];
        return 0;
    case 'i':
        if (get_u32(r, &n) < 0)
            return -1;
        v->is_int = 1;
        v->num = (long)(int32_t)n;
        break;
    case 'z':
    case 'Z':
        if (r->p >= r->end)
            return -1;
        n = *r->p++;
        goto text;
    case 'u':
    case 't':
    case 'a':
    case 'A':
        if (get_u32(r, &n) < 0)
            return -1;
    text:
        if ((size_t)(r->end - r->p) < n)
            return -1;
        v->str = r->p;
        v->len = n;
        r->p += n;
        break;
    default:
        return -1;
    }
    if (ref) {
        if (r->nrefs >= (int)(sizeof r->refs / sizeof r->refs[0]))
            return -1;
        r->refs[r->nrefs++] = *v;
    }
    return 0;
}

static int is(const struct value *v, const char *s) {
    return !v->is_int && v->len == strlen(s) && memcmp(v->str, s, v->len) == 0;
}

/* A reply's "event" (or "" if none) and its "code". */
static int parse_reply(const unsigned char *data, size_t len, char *event, size_t event_size, long *code) {
    struct reader r = {.p = data, .end = data + len};
    struct value key, val;
    event[0] = '\0';
    if (len < 1 || (data[0] & 0x7f) != '{')
        return -1;
    if (data[0] & 0x80)
        r.refs[r.nrefs++] = (struct value){0}; /* (the dict's own ref number) */
    r.p++;
    while (r.p < r.end && *r.p != '0') {
        if (get_value(&r, &key) < 0 || get_value(&r, &val) < 0)
            return -1;
        if (is(&key, "event") && !val.is_int)
            snprintf(event, event_size, "%.*s", (int)val.len, (const char *)val.str);
        else if (is(&key, "code") && val.is_int)
            *code = val.num;
    }
    return r.p < r.end ? 0 : -1;
}

static int send_message(int s, const struct buf *b, const int *fds, int nfds) {
    struct iovec iov = {.iov_base = b->data, .iov_len = b->len};
    union {
        struct cmsghdr align;
        char space[CMSG_SPACE(4 * sizeof(int))];
    } control;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        msg.msg_control = control.space;
        msg.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, (size_t)nfds * sizeof(int));
    }
    return sendmsg(s, &msg, MSG_NOSIGNAL) == (ssize_t)b->len ? 0 : -1;
}

/* ---- the run ----------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    sigset_t forwarded;
    sigemptyset(&forwarded);
    for (size_t i = 0; i < NFORWARDED; i++)
        sigaddset(&forwarded, FORWARDED[i]);
    /* Held from here: one that comes before the launcher has the command is taken as the fallback
     * unblocks them, or forwarded once the launcher's process exists. */
    sigprocmask(SIG_BLOCK, &forwarded, &original_mask);
    if (!handed_over(argc, argv))
        fallback(argc, argv);
    int s = connect_launcher();
    if (s < 0)
        fallback(argc, argv);
    size_t nenv = 0;
    while (environ[nenv])
        nenv++;
    struct buf req = {.data = malloc(MAX_MESSAGE), .cap = MAX_MESSAGE};
    int cwd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (req.data == NULL || cwd < 0)
        fallback(argc, argv);
    mode_t mask = umask(0);
    umask(mask);
    put(&req, "{", 1);
    put_text(&req, "op");
    put_text(&req, "cli");
    put_text(&req, "argv");
    put_list(&req, argv + 1, (size_t)argc - 1);
    put_text(&req, "env");
    put_list(&req, environ, nenv);
    put_text(&req, "umask");
    put_i32(&req, 'i', (uint32_t)mask);
    put(&req, "0", 1);
    int fds[4] = {cwd, 0, 1, 2};
    if (req.full || send_message(s, &req, fds, 4) < 0)
        fallback(argc, argv);
    close(cwd);
    int sfd = signalfd(-1, &forwarded, SFD_CLOEXEC);
    if (sfd < 0)
        fallback(argc, argv);

    int started = 0;
    unsigned char reply[4096];
    for (;;) {
        /* Until "started", signals wait (blocked): a fallback's Python CLI, or the default action as
         * it unblocks them, takes them; from then on they go to the launcher's process. */
        struct pollfd pfd[2] = {{.fd = s, .events = POLLIN}, {.fd = sfd, .events = POLLIN}};
        if (poll(pfd, started ? 2 : 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pfd[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            if (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
                req.len = 0;
                put(&req, "{", 1);
                put_text(&req, "op");
                put_text(&req, "signal");
                put_text(&req, "sig");
                put_i32(&req, 'i', si.ssi_signo);
                put(&req, "0", 1);
                send_message(s, &req, NULL, 0);
            }
        }
        if (!(pfd[0].revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        ssize_t n = recv(s, reply, sizeof reply, 0);
        char event[32];
        long code = 125;
        if (n > 0 && parse_reply(reply, (size_t)n, event, sizeof event, &code) == 0) {
            if (strcmp(event, "started") == 0) {
                started = 1;
                continue;
            }
            if (strcmp(event, "refused") == 0 && !started)
                fallback(argc, argv);
            if (strcmp(event, "exit") == 0 && started)
                return code >= 0 && code <= 255 ? (int)code : 125;
            continue; /* (nothing else is sent to a front) */
        }
        if (n < 0 && errno == EINTR)
            continue;
        break; /* gone, or a reply that is not one */
    }
    if (!started)
        fallback(argc, argv);
    fprintf(stderr, "agentcell %s: warm launcher: it went away while the command ran (see 'agentcell warm "
                    "status'; AGENTCELL_FRONT=off starts without it)\n", argv[1]);
    return 125;
}
