/*
 * The pod sandbox's first process (the "pause" container) for the offline cluster tests: it holds
 * the pod's namespaces and does nothing else. It reaps any child handed to it (it is PID 1 of the
 * pod when the pod shares its PID namespace), exits 0 on SIGTERM or SIGINT so that a sandbox stops
 * at once, and otherwise sleeps in pause(2). deploy/image/build.py compiles it with
 * `gcc -static -Os` into an image holding this one file.
 */
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signo) {
    (void)signo;
    _exit(0);
}

static void reap(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

static int handle(int signo, void (*handler)(int), int flags) {
    struct sigaction action = {0};
    action.sa_handler = handler;
    action.sa_flags = flags;
    sigemptyset(&action.sa_mask);
    return sigaction(signo, &action, NULL);
}

int main(void) {
    if (handle(SIGTERM, stop, 0) < 0 || handle(SIGINT, stop, 0) < 0 ||
        handle(SIGCHLD, reap, SA_NOCLDSTOP | SA_RESTART) < 0) {
        static const char message[] = "pause: sigaction failed\n";
        (void)!write(2, message, sizeof message - 1);
        return 1;
    }
    for (;;) {
        pause();
    }
}
