# Site profiles: where they are, how they are read.  Sourced by slurm/submit.sh and slurm/lib/job.sh.
#
# A profile (slurm/sites/NAME.env) is a bash file of SITE_* settings and an optional site_setup function.
# Any SITE_* variable already set in the environment wins over the profile, so a value can be given without
# editing any file:   SITE_ACCOUNT=m1234_g slurm/submit.sh 6 --site perlmutter
# (set but empty counts: `SITE_CONSTRAINT= slurm/submit.sh ...` drops the profile's constraint).

COURSE_SITE_VARS=(
    SITE_DESCRIPTION SITE_ACCOUNT SITE_ACCOUNT_REQUIRED SITE_ACCOUNT_SUFFIX SITE_PARTITION SITE_QOS
    SITE_CONSTRAINT SITE_GPU_FLAG SITE_GPU_TYPE SITE_GPUS_PER_NODE SITE_TASKS_PER_NODE SITE_CPUS_PER_TASK
    SITE_SBATCH_EXTRA
)

# The directory of the profiles shipped with the course.
course_sites_dir() {
    echo "$COURSE_REPO/slurm/sites"
}

# NAME (a profile in slurm/sites/) or a path to a .env file -> the absolute path of the profile; 1 if none.
course_site_file() {
    local site="$1" file
    if [[ "$site" == */* || "$site" == *.env ]]; then
        file="$site"
    else
        file="$(course_sites_dir)/$site.env"
    fi
    [[ -f "$file" ]] || return 1
    echo "$(cd "$(dirname "$file")" && pwd)/$(basename "$file")"
}

# The names of the shipped profiles, one line.
course_site_names() {
    local file names=()
    for file in "$(course_sites_dir)"/*.env; do
        [[ -e "$file" ]] && names+=("$(basename "$file" .env)")
    done
    echo "${names[*]}"
}

# Reads a profile: clears every SITE_* setting and site_setup, sources FILE, then puts back the values the
# environment had (COURSE_SITE_FROM_ENV lists their names).
course_load_site() {
    local file="$1" var
    local -A from_env=()
    for var in "${COURSE_SITE_VARS[@]}"; do
        if [[ -n "${!var+set}" ]]; then
            from_env[$var]="${!var}"
        fi
    done
    for var in "${COURSE_SITE_VARS[@]}"; do
        unset "$var"
    done
    unset -f site_setup
    # shellcheck source=/dev/null
    source "$file"
    COURSE_SITE_FROM_ENV=""
    for var in "${COURSE_SITE_VARS[@]}"; do
        if [[ -n "${from_env[$var]+set}" ]]; then
            printf -v "$var" '%s' "${from_env[$var]}"
            COURSE_SITE_FROM_ENV+="${COURSE_SITE_FROM_ENV:+ }$var"
        fi
    done
}
